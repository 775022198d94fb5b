"""`Placement`: which logical expert each physical expert slot holds, per MoE layer, and what that does to the
GPUs' loads (the imbalance metric: the slowest GPU's load over the mean, per layer).

A value object: the EP MoE layer reads `phy2log` / `log2phy` / `logcnt` (DeepSeek's EPLB arrays) to load its
slots and route tokens to replicas; `changed_slots` lists what a reassignment moves. Slot `s` lives on GPU
`s // slots_per_gpu`. A token routed to an expert with `c` replicas is counted as `1 / c` on each replica (the
dispatch spreads an expert's tokens evenly over its replicas).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .eplb import as_load_rows, rebalance_experts


@dataclass(frozen=True, slots=True)
class Placement:
    """Expert placement of every MoE layer over `num_gpus` GPUs: the three arrays `rebalance_experts` returns,
    as tuples. Build one with `from_loads` (EPLB) or `contiguous` (no EPLB: expert e on GPU e // (E / G))."""

    phy2log: tuple[tuple[int, ...], ...]  # [layers][slots]: the logical expert in each slot
    log2phy: tuple[tuple[tuple[int, ...], ...], ...]  # [layers][experts][max replicas]: slots, -1 padded
    logcnt: tuple[tuple[int, ...], ...]  # [layers][experts]: replicas of each expert
    num_gpus: int
    num_nodes: int = 1  # GPUs are numbered node by node; `aligned_to` renumbers them only inside a node

    def __post_init__(self) -> None:
        if not self.phy2log or len({len(self.phy2log), len(self.log2phy), len(self.logcnt)}) != 1:
            raise ValueError("phy2log, log2phy and logcnt must hold the same number (>= 1) of layers")
        slots, experts = len(self.phy2log[0]), len(self.logcnt[0])
        if self.num_gpus < 1 or slots % self.num_gpus:
            raise ValueError(f"{slots} slots per layer do not divide over num_gpus={self.num_gpus}")
        if self.num_nodes < 1 or self.num_gpus % self.num_nodes:
            raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of num_nodes={self.num_nodes}")
        for layer, (p2l, l2p, cnt) in enumerate(zip(self.phy2log, self.log2phy, self.logcnt)):
            if len(p2l) != slots or len(cnt) != experts or len(l2p) != experts:
                raise ValueError(f"layer {layer}: ragged placement arrays")
            slots_of: list[list[int]] = [[] for _ in range(experts)]
            for slot, expert in enumerate(p2l):
                if not 0 <= expert < experts:
                    raise ValueError(f"layer {layer}: slot {slot} holds expert {expert}, not in [0, {experts})")
                slots_of[expert].append(slot)
            if [len(s) for s in slots_of] != list(cnt) or min(cnt) < 1:
                raise ValueError(f"layer {layer}: logcnt does not count phy2log, or an expert has no replica")
            for expert, row in enumerate(l2p):
                if sorted(s for s in row if s >= 0) != slots_of[expert]:
                    raise ValueError(f"layer {layer}: log2phy of expert {expert} does not match phy2log")

    @classmethod
    def from_loads(cls, loads: object, num_gpus: int, num_redundant_experts: int = 0, num_groups: int = 1,
                   num_nodes: int = 1) -> Placement:
        """EPLB's placement for `[layers][experts]` loads with `num_redundant_experts` extra slots per layer
        (in total, as vLLM counts them: a multiple of `num_gpus`)."""
        rows = as_load_rows(loads)
        num_replicas = len(rows[0]) + num_redundant_experts
        phy2log, log2phy, logcnt = rebalance_experts(rows, num_replicas, num_groups, num_nodes, num_gpus)
        return cls(_tuples(phy2log), tuple(_tuples(layer) for layer in log2phy), _tuples(logcnt), num_gpus,
                   num_nodes)

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, num_gpus: int) -> Placement:
        """No EPLB: no redundant slots, GPU g holds experts g * E / G ... (E / G consecutive experts)."""
        if num_layers < 1 or num_experts < 1 or num_gpus < 1 or num_experts % num_gpus:
            raise ValueError(f"{num_experts} experts do not divide over {num_gpus} GPUs (layers: {num_layers})")
        layer = tuple(range(num_experts))
        return cls((layer,) * num_layers, (tuple((e,) for e in layer),) * num_layers,
                   ((1,) * num_experts,) * num_layers, num_gpus)

    @property
    def num_layers(self) -> int:
        return len(self.phy2log)

    @property
    def num_logical_experts(self) -> int:
        return len(self.logcnt[0])

    @property
    def num_physical_experts(self) -> int:
        return len(self.phy2log[0])

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical_experts // self.num_gpus

    def gpu_loads(self, counts: object) -> list[list[float]]:
        """`[layers][gpus]`: the tokens each GPU's experts compute, for `[layers][logical experts]` counts."""
        rows = self._check_counts(counts)
        per_gpu = self.slots_per_gpu
        loads = []
        for row, p2l, cnt in zip(rows, self.phy2log, self.logcnt):
            share = [c / n for c, n in zip(row, cnt)]
            slot = [share[e] for e in p2l]
            loads.append([sum(slot[g * per_gpu:(g + 1) * per_gpu]) for g in range(self.num_gpus)])
        return loads

    def imbalance(self, counts: object) -> list[float]:
        """Per layer: the most loaded GPU's tokens over the mean GPU's (1.0 = perfect; a layer with no tokens
        counts as 1.0). DeepSeek's "slowest rank / mean" for a compute-bound MoE."""
        return [max(g) * len(g) / sum(g) if sum(g) > 0 else 1.0 for g in self.gpu_loads(counts)]

    def logical_counts(self, physical_counts: object) -> list[list[float]]:
        """`[layers][logical experts]` from counters kept per physical slot `[layers][slots]`."""
        rows = as_load_rows(physical_counts)
        if len(rows) != self.num_layers or len(rows[0]) != self.num_physical_experts:
            raise ValueError(f"physical counts must be [{self.num_layers}][{self.num_physical_experts}], got "
                             f"[{len(rows)}][{len(rows[0])}]")
        out = []
        for row, p2l in zip(rows, self.phy2log):
            logical = [0.0] * self.num_logical_experts
            for c, e in zip(row, p2l):
                logical[e] += c
            out.append(logical)
        return out

    def changed_slots(self, other: Placement) -> list[list[int]]:
        """Per layer, the slots whose expert differs in `other`: the weights a switch to `other` must move."""
        if (other.num_layers, other.num_physical_experts, other.num_gpus) != (
                self.num_layers, self.num_physical_experts, self.num_gpus):
            raise ValueError("placements of different shapes (layers, slots, GPUs) cannot be compared")
        return [[s for s, (a, b) in enumerate(zip(mine, theirs)) if a != b]
                for mine, theirs in zip(self.phy2log, other.phy2log)]

    def aligned_to(self, previous: Placement) -> Placement:
        """This placement with its GPUs (inside each node) and each GPU's slots renumbered so that as many slots
        as possible keep the expert they hold in `previous`. Every GPU keeps its set of replicas, so every load
        and imbalance is unchanged; only fewer weights move. (EPLB numbers GPUs and slots in packing order, so a
        small change of the loads would otherwise renumber nearly every slot.) Deterministic: every rank gets
        the same result. GPUs are paired greedily by the replicas they share, largest overlap first."""
        if (previous.num_layers, previous.num_physical_experts, previous.num_gpus, previous.num_nodes) != (
                self.num_layers, self.num_physical_experts, self.num_gpus, self.num_nodes):
            raise ValueError("placements of different shapes (layers, slots, GPUs, nodes) cannot be aligned")
        phy2log, log2phy = [], []
        for layer in range(self.num_layers):
            p2l, l2p = _align_layer(self.phy2log[layer], self.log2phy[layer], previous.phy2log[layer],
                                    self.num_gpus, self.num_nodes)
            phy2log.append(p2l)
            log2phy.append(l2p)
        return Placement(tuple(phy2log), tuple(log2phy), self.logcnt, self.num_gpus, self.num_nodes)

    def with_layers_from(self, other: Placement, layers: Sequence[int]) -> Placement:
        """This placement with the rows of `layers` taken from `other` (a reassignment of some layers only)."""
        if (other.num_layers, other.num_physical_experts, other.num_gpus, other.num_nodes) != (
                self.num_layers, self.num_physical_experts, self.num_gpus, self.num_nodes):
            raise ValueError("placements of different shapes (layers, slots, GPUs, nodes) cannot be mixed")
        chosen = set(layers)
        pick = [other if layer in chosen else self for layer in range(self.num_layers)]
        width = max(max(p.logcnt[layer]) for layer, p in enumerate(pick))
        log2phy = tuple(tuple(row[:width] + (-1,) * (width - len(row)) for row in p.log2phy[layer])
                        for layer, p in enumerate(pick))
        return Placement(tuple(p.phy2log[layer] for layer, p in enumerate(pick)), log2phy,
                         tuple(p.logcnt[layer] for layer, p in enumerate(pick)), self.num_gpus, self.num_nodes)

    def _check_counts(self, counts: object) -> list[list[float]]:
        rows = as_load_rows(counts)
        if len(rows) != self.num_layers or len(rows[0]) != self.num_logical_experts:
            raise ValueError(f"counts must be [{self.num_layers}][{self.num_logical_experts}] (layers, logical "
                             f"experts), got [{len(rows)}][{len(rows[0])}]")
        return rows


def _align_layer(new: tuple[int, ...], new_l2p: tuple[tuple[int, ...], ...], old: tuple[int, ...], num_gpus: int,
                 num_nodes: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    per_gpu, gpus_per_node = len(new) // num_gpus, num_gpus // num_nodes
    rank_of = {slot: r for row in new_l2p for r, slot in enumerate(row) if slot >= 0}
    # each new GPU's replicas as (expert, replica rank); the old GPUs holding each expert
    replicas = [[(new[s], rank_of[s]) for s in range(g * per_gpu, (g + 1) * per_gpu)] for g in range(num_gpus)]
    old_gpus_of: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        old_gpus_of.setdefault(e, []).append(s // per_gpu)
    target = [-1] * num_gpus  # new GPU -> its number in the aligned placement
    for node in range(num_nodes):
        gpus = range(node * gpus_per_node, (node + 1) * gpus_per_node)
        overlap: dict[tuple[int, int], int] = {}
        for g in gpus:
            for e, _ in replicas[g]:
                for h in old_gpus_of.get(e, ()):
                    if h in gpus:
                        overlap[g, h] = overlap.get((g, h), 0) + 1
        taken = set()
        for (g, h), _ in sorted(overlap.items(), key=lambda item: (-item[1], item[0])):
            if target[g] < 0 and h not in taken:
                target[g] = h
                taken.add(h)
        free = iter(h for h in gpus if h not in taken)
        for g in gpus:
            if target[g] < 0:
                target[g] = next(free)
    p2l, ranks = [0] * len(new), [0] * len(new)
    for g, h in enumerate(target):
        pending: dict[int, list[int]] = {}  # expert -> its replica ranks still to place on this GPU
        for e, r in replicas[g]:
            pending.setdefault(e, []).append(r)
        open_slots = []
        for s in range(h * per_gpu, (h + 1) * per_gpu):  # a replica of the old slot's expert stays in the slot
            if pending.get(old[s]):
                p2l[s], ranks[s] = old[s], pending[old[s]].pop(0)
            else:
                open_slots.append(s)
        rest = [(e, r) for e, rs in pending.items() for r in rs]
        for s, (e, r) in zip(open_slots, rest):
            p2l[s], ranks[s] = e, r
    l2p = [list(row) for row in new_l2p]
    for s, (e, r) in enumerate(zip(p2l, ranks)):
        l2p[e][r] = s
    return tuple(p2l), tuple(tuple(row) for row in l2p)


def _tuples(rows: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in rows)
