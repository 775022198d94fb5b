"""`rebalance_experts`: DeepSeek's expert-parallel load balancer (EPLB), in plain Python.

The algorithm is the one DeepSeek published (github.com/deepseek-ai/EPLB); this is our own code, with the same
inputs and the same output contract, so placements can be compared with theirs.

Each MoE layer has `E` logical experts and `R >= E` physical slots, `R / num_gpus` on each GPU; GPU `g` holds
slots `g * R / num_gpus ...`, and GPUs are numbered node by node. A logical expert with `c` replicas is assumed to
have its tokens split evenly among them, so each replica carries `load / c`.

Hierarchical policy (`num_groups % num_nodes == 0`), for each layer:
1. Pack the expert groups onto nodes, the same number of groups on each, balancing the nodes' loads (group-
   limited routing then keeps a token's experts on few nodes).
2. Inside each node, give the node's `R / num_nodes - E / num_nodes` redundant slots one at a time to the expert
   whose replicas are the most loaded (largest `load / count`).
3. Pack the node's replicas onto its GPUs, the same number on each, balancing the GPUs' loads.

Global policy (groups do not divide over nodes): the same with one group and one node, i.e. replication over all
experts and packing over all GPUs, ignoring groups.

Balanced packing is the greedy "heaviest item to the lightest bin that still has room" (ties: the lower index).
It is a heuristic, not an optimum: tests compare it with brute force on small cases.

Plain Python (deepserve.core imports no numpy or torch): `weight` is any `[layers][experts]` array-like (lists,
or anything with `.tolist()`: numpy arrays, torch tensors); outputs are nested lists of ints, which
`torch.tensor(...)` turns into the tensors DeepSeek's function returns.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def rebalance_experts(
    weight: object, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
    """Replicate and place the logical experts of every layer on `num_gpus` GPUs in `num_nodes` nodes.

    weight: `[layers, logical experts]` load statistics (token counts), non-negative.
    num_replicas: physical expert slots per layer, a multiple of `num_gpus` and at least the expert count.
    num_groups: expert groups (group-limited routing; 1 when the model has none), dividing the expert count.
    num_nodes: server nodes (intra-node links are the fast ones); `num_gpus` must be a multiple of it.
    num_gpus: GPUs in the expert-parallel group.

    Returns `(phy2log, log2phy, logcnt)`:
    phy2log `[layers][num_replicas]`: the logical expert each physical slot holds;
    log2phy `[layers][experts][max replicas]`: each expert's slots by replica rank, padded with -1 (the pad is
        the largest replica count over all layers, as in DeepSeek's function);
    logcnt `[layers][experts]`: each expert's replica count (>= 1; each layer's counts sum to `num_replicas`).
    """
    rows = as_load_rows(weight)
    num_experts = len(rows[0])
    _check_sizes(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        groups, nodes = num_groups, num_nodes
    else:  # the global policy
        groups, nodes = 1, 1
    phy2log, phyrank, logcnt = [], [], []
    for row in rows:
        p2l, rank, cnt = _place_layer(row, num_replicas, groups, nodes, num_gpus)
        phy2log.append(p2l)
        phyrank.append(rank)
        logcnt.append(cnt)
    width = max(max(cnt) for cnt in logcnt)
    log2phy = []
    for p2l, rank in zip(phy2log, phyrank):
        slots = [[-1] * width for _ in range(num_experts)]
        for slot, (expert, r) in enumerate(zip(p2l, rank)):
            slots[expert][r] = slot
        log2phy.append(slots)
    return phy2log, log2phy, logcnt


def balanced_packing(weights: Sequence[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Pack `n` items into `num_packs` packs of exactly `n / num_packs` items each, heaviest item first into the
    lightest pack that has room. Returns each item's pack and its rank (order of arrival) in that pack."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"cannot pack {n} items into {num_packs} equal packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return list(range(n)), [0] * n
    pack_of, rank_in_pack = [0] * n, [0] * n
    open_packs = [(0.0, pack, 0) for pack in range(num_packs)]  # (load, pack, items): the lightest pops first
    for item in sorted(range(n), key=lambda i: -weights[i]):  # stable: equal weights keep index order
        load, pack, items = heapq.heappop(open_packs)
        pack_of[item], rank_in_pack[item] = pack, items
        if items + 1 < per_pack:
            heapq.heappush(open_packs, (load + weights[item], pack, items + 1))
    return pack_of, rank_in_pack


def replicate_experts(weights: Sequence[float], num_physical: int) -> tuple[list[int], list[int], list[int]]:
    """Give `num_physical - len(weights)` extra replicas, one at a time, to the expert with the largest load per
    replica (ties: the lower index). Slot `i < len(weights)` holds expert `i`; the extra slots follow in the order
    they were given. Returns each slot's expert, each slot's replica rank and each expert's replica count."""
    num_log = len(weights)
    if num_physical < num_log:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_log} experts")
    phy2log, rank, count = list(range(num_log)), [0] * num_log, [1] * num_log
    heaviest = [(-w, e) for e, w in enumerate(weights)]
    heapq.heapify(heaviest)
    for _ in range(num_physical - num_log):
        _, expert = heapq.heappop(heaviest)
        phy2log.append(expert)
        rank.append(count[expert])
        count[expert] += 1
        heapq.heappush(heaviest, (-weights[expert] / count[expert], expert))
    return phy2log, rank, count


def _place_layer(
    row: list[float], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[list[int], list[int], list[int]]:
    """One layer of the hierarchical policy: (slot -> expert, slot -> replica rank, expert -> replica count)."""
    num_experts = len(row)
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node, slots_per_node = num_experts // num_nodes, num_replicas // num_nodes
    gpus_per_node, slots_per_gpu = num_gpus // num_nodes, num_replicas // num_gpus

    # 1. groups to nodes; node_major lists the experts node by node (a node's groups in packing order)
    group_load = [sum(row[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    node_major = [0] * num_experts
    for g in range(num_groups):
        first = (group_node[g] * groups_per_node + group_rank[g]) * group_size
        node_major[first:first + group_size] = range(g * group_size, (g + 1) * group_size)

    phy2log, phyrank, logcnt = [0] * num_replicas, [0] * num_replicas, [0] * num_experts
    for node in range(num_nodes):
        members = node_major[node * experts_per_node:(node + 1) * experts_per_node]
        loads = [row[e] for e in members]
        # 2. redundant replicas inside the node
        slot_member, slot_rank, member_count = replicate_experts(loads, slots_per_node)
        # 3. the node's replicas to its GPUs; a GPU's slots in the order they were packed
        replica_load = [loads[m] / member_count[m] for m in slot_member]
        gpu_of, rank_on_gpu = balanced_packing(replica_load, gpus_per_node)
        for i, m in enumerate(slot_member):
            slot = node * slots_per_node + gpu_of[i] * slots_per_gpu + rank_on_gpu[i]
            phy2log[slot], phyrank[slot] = members[m], slot_rank[i]
        for m, count in enumerate(member_count):
            logcnt[members[m]] = count
    return phy2log, phyrank, logcnt


def as_load_rows(weight: object) -> list[list[float]]:
    """`weight` (lists, or anything with `.tolist()`) as a rectangular list of finite, non-negative floats, or a ValueError naming what is wrong."""
    rows = weight.tolist() if hasattr(weight, "tolist") else weight
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows:
        raise ValueError("weight must be a non-empty [layers, experts] array of expert loads")
    out = []
    for layer, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not row:
            raise ValueError(f"weight[{layer}] must be a non-empty row of expert loads, got {row!r:.60}")
        if len(row) != len(rows[0]):
            raise ValueError(f"weight is not rectangular: row {layer} has {len(row)} experts, row 0 {len(rows[0])}")
        values = []
        for expert, w in enumerate(row):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise ValueError(f"weight[{layer}][{expert}] must be a finite load >= 0, got {w!r}")
            values.append(float(w))
        out.append(values)
    return out


def _check_sizes(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide the {num_experts} experts")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of num_nodes={num_nodes}")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} is not a multiple of num_gpus={num_gpus}")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} is fewer than the {num_experts} experts")
