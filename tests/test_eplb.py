"""`rebalance_experts` (DeepSeek's EPLB placement) and the `Placement` value object: DeepSeek's published example,
the output contract, brute-force optima on small cases, and a plain greedy placement's balance."""

from __future__ import annotations

import itertools
import random

import pytest

from deepserve.core.balance import Placement, rebalance_experts
from deepserve.core.balance.eplb import balanced_packing, replicate_experts

# The example in github.com/deepseek-ai/EPLB's README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes,
# 8 GPUs, and the phy2log it prints.
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def zipf_loads(num_layers: int, num_experts: int, exponent: float, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_layers):
        ranks = list(range(1, num_experts + 1))
        rng.shuffle(ranks)
        rows.append([1000.0 / r ** exponent for r in ranks])
    return rows


def gpu_max(phy2log_row, logcnt_row, loads, num_gpus):
    per = len(phy2log_row) // num_gpus
    share = [loads[e] / logcnt_row[e] for e in phy2log_row]
    return max(sum(share[g * per:(g + 1) * per]) for g in range(num_gpus))


def best_packing_max(weights, num_packs):
    """The smallest possible heaviest pack, packs of equal item counts (exhaustive, with pruning)."""
    per, best = len(weights) // num_packs, float("inf")

    def place(i, loads, counts):
        nonlocal best
        if max(loads) >= best:
            return
        if i == len(weights):
            best = max(loads)
            return
        tried = set()
        for p in range(num_packs):
            if counts[p] < per and (loads[p], counts[p]) not in tried:
                tried.add((loads[p], counts[p]))
                loads[p] += weights[i]
                counts[p] += 1
                place(i + 1, loads, counts)
                loads[p] -= weights[i]
                counts[p] -= 1

    place(0, [0.0] * num_packs, [0] * num_packs)
    return best


def test_matches_deepseeks_published_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log == README_PHY2LOG
    assert logcnt[0] == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]
    assert log2phy[0][5] == [0, 2] and log2phy[0][0] == [12, -1]  # by replica rank, -1 padded to 2


@pytest.mark.parametrize("layers,experts,replicas,groups,nodes,gpus", [
    (3, 16, 24, 4, 2, 4),    # hierarchical
    (2, 16, 16, 1, 1, 4),    # no redundant slots
    (2, 12, 18, 3, 2, 6),    # 3 groups over 2 nodes: the global policy
    (4, 256, 320, 1, 1, 64),  # V4-Flash decode at EP64, one redundant per GPU
    (2, 256, 288, 8, 2, 8),  # V3-style 8 groups over 2 nodes
])
def test_contract(layers, experts, replicas, groups, nodes, gpus):
    weight = zipf_loads(layers, experts, 1.0, seed=experts + gpus)
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    width = max(max(c) for c in logcnt)
    assert len(phy2log) == len(log2phy) == len(logcnt) == layers
    for p2l, l2p, cnt in zip(phy2log, log2phy, logcnt):
        assert len(p2l) == replicas and len(cnt) == experts and min(cnt) >= 1 and sum(cnt) == replicas
        assert [p2l.count(e) for e in range(experts)] == cnt
        for e, slots in enumerate(l2p):
            assert len(slots) == width
            real = [s for s in slots if s >= 0]
            assert real == slots[:cnt[e]] and all(p2l[s] == e for s in real)
    Placement(tuple(map(tuple, phy2log)), tuple(tuple(map(tuple, x)) for x in log2phy),
              tuple(map(tuple, logcnt)), gpus)  # its own validation agrees


def test_hierarchical_policy_keeps_each_group_on_one_node():
    weight = zipf_loads(3, 32, 1.2, seed=3)
    phy2log, _, _ = rebalance_experts(weight, 48, 8, 2, 8)
    for row in phy2log:
        node_groups = [{e // 4 for e in row[n * 24:(n + 1) * 24]} for n in range(2)]
        assert len(node_groups[0]) == len(node_groups[1]) == 4 and not node_groups[0] & node_groups[1]


def test_global_policy_when_groups_do_not_divide_nodes():
    # one group holds all the load; with 3 groups on 2 nodes the groups are ignored and its experts spread out
    weight = [[100.0] * 4 + [1.0] * 8]
    phy2log, _, logcnt = rebalance_experts(weight, 12, 3, 2, 4)
    assert (phy2log, logcnt) == rebalance_experts(weight, 12, 1, 1, 4)[::2]
    heavy_on = {slot // 3 for slot, e in enumerate(phy2log[0]) if e < 4}
    assert heavy_on == {0, 1, 2, 3}  # one heavy expert per GPU, on both nodes


def test_replication_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        experts, extra = rng.randint(1, 5), rng.randint(0, 4)
        loads = [float(rng.randint(0, 50)) for _ in range(experts)]
        _, _, count = replicate_experts(loads, experts + extra)
        best = min(max(w / c for w, c in zip(loads, cs))
                   for cs in itertools.product(range(1, extra + 2), repeat=experts) if sum(cs) == experts + extra)
        assert max(w / c for w, c in zip(loads, count)) == pytest.approx(best)


def test_packing_against_brute_force():
    rng = random.Random(1)
    ratios = []
    for _ in range(150):
        packs, per = rng.choice([2, 3, 4]), rng.choice([2, 3])
        weights = [float(rng.randint(1, 100)) for _ in range(packs * per)]
        pack_of, rank = balanced_packing(weights, packs)
        assert sorted(zip(pack_of, rank)) == [(p, r) for p in range(packs) for r in range(per)]
        heaviest = max(sum(w for w, p in zip(weights, pack_of) if p == q) for q in range(packs))
        ratios.append(heaviest / best_packing_max(weights, packs))
    # a greedy heuristic: optimal in most cases, never far off (worst seen 1.15; LPT's classic bound is 4/3)
    assert min(ratios) >= 1 - 1e-12 and max(ratios) <= 4 / 3
    assert sum(r < 1 + 1e-9 for r in ratios) / len(ratios) >= 0.6


def test_whole_placement_against_brute_force():
    """Replication and packing together against every replica count vector with its best packing."""
    rng = random.Random(2)
    ratios = []
    for _ in range(60):
        gpus, experts = rng.choice([2, 3]), rng.choice([3, 4, 6])
        replicas = experts + gpus * rng.randint(0, 1) + (-experts % gpus)
        loads = [float(rng.randint(1, 60)) for _ in range(experts)]
        phy2log, _, logcnt = rebalance_experts([loads], replicas, 1, 1, gpus)
        ours = gpu_max(phy2log[0], logcnt[0], loads, gpus)
        best = min(best_packing_max([w / c for w, c in zip(loads, cs) for _ in range(c)], gpus)
                   for cs in itertools.product(range(1, replicas - experts + 2), repeat=experts)
                   if sum(cs) == replicas)
        ratios.append(ours / best)
    assert min(ratios) >= 1 - 1e-12 and max(ratios) <= 4 / 3
    # the replication step minimises the heaviest replica, not the heaviest GPU, so the joint optimum is missed
    # more often on such coarse cases (seen: optimal in 45%, mean 1.027, worst 1.12)
    assert sum(ratios) / len(ratios) <= 1.05 and sum(r < 1 + 1e-9 for r in ratios) / len(ratios) >= 0.4


def plain_greedy_imbalance(loads, num_gpus):
    """No replicas; each expert in index order to the least loaded GPU that still has room."""
    per, gpu_load, gpu_count = len(loads) // num_gpus, [0.0] * num_gpus, [0] * num_gpus
    for w in loads:
        g = min((g for g in range(num_gpus) if gpu_count[g] < per), key=gpu_load.__getitem__)
        gpu_load[g] += w
        gpu_count[g] += 1
    return max(gpu_load) * num_gpus / sum(gpu_load)


@pytest.mark.parametrize("gpus,redundant_per_gpu", [(4, 0), (8, 1), (16, 1), (8, 4)])
def test_beats_a_plain_greedy_placement(gpus, redundant_per_gpu):
    loads = zipf_loads(8, 256, 1.0, seed=gpus)
    placement = Placement.from_loads(loads, gpus, gpus * redundant_per_gpu)
    ours = placement.imbalance(loads)
    greedy = [plain_greedy_imbalance(row, gpus) for row in loads]
    assert all(a <= b + 1e-9 for a, b in zip(ours, greedy))
    assert sum(ours) / len(ours) < sum(greedy) / len(greedy) - 0.005
    if redundant_per_gpu:
        assert max(ours) < 1.05  # replicas of the hottest experts flatten a Zipf(1) layer


def test_accepts_arrays_and_returns_deepseeks_shapes():
    torch = pytest.importorskip("torch")
    weight = torch.tensor(README_WEIGHT)
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log == README_PHY2LOG
    assert tuple(torch.tensor(log2phy).shape) == (2, 12, 2) and tuple(torch.tensor(logcnt).shape) == (2, 12)


@pytest.mark.parametrize("weight,args,message", [
    ([], (4, 1, 1, 2), "non-empty"),
    ([[1, 2], [3]], (2, 1, 1, 2), "not rectangular"),
    ([[1, -2]], (2, 1, 1, 2), r"weight\[0\]\[1\] must be a finite load"),
    ([[1, float("nan")]], (2, 1, 1, 2), "finite"),
    ([[1, "2"]], (2, 1, 1, 2), "finite"),
    ([[1, 2, 3, 4]], (4, 3, 1, 2), "num_groups=3 does not divide"),
    ([[1, 2, 3, 4]], (6, 1, 1, 4), "not a multiple of num_gpus"),
    ([[1, 2, 3, 4]], (4, 1, 2, 3), "not a multiple of num_nodes"),
    ([[1, 2, 3, 4]], (2, 1, 1, 2), "fewer than the 4 experts"),
    ([[1, 2, 3, 4]], (4, 1, 1, 0), "num_gpus must be a positive int"),
])
def test_bad_input_is_named(weight, args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(weight, *args)


def test_placement_loads_moves_and_counts():
    loads = [[8.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]]
    none = Placement.contiguous(2, 4, 2)
    assert none.gpu_loads(loads) == [[9.0, 3.0], [2.0, 2.0]]
    assert none.imbalance(loads) == [1.5, 1.0]
    assert none.imbalance([[0, 0, 0, 0], [0, 0, 0, 0]]) == [1.0, 1.0]
    eplb = Placement.from_loads(loads, 2, num_redundant_experts=2)
    assert eplb.logcnt[0] == (3, 1, 1, 1)  # the hot expert gets both replicas (8 / 2 > 2)
    assert eplb.gpu_loads(loads)[0] == pytest.approx([19 / 3, 17 / 3])
    assert eplb.imbalance(loads)[0] == pytest.approx(19 / 18)
    assert none.changed_slots(none) == [[], []]
    with pytest.raises(ValueError, match="different shapes"):
        none.changed_slots(eplb)
    physical = [[4.0, 1.0, 1.0, 2.0, 1.0, 4.0], [1.0] * 6]
    logical = eplb.logical_counts(physical)
    assert [sum(row) for row in logical] == [13.0, 6.0] and all(c > 0 for c in logical[0])
    assert logical[0][0] == sum(c for c, e in zip(physical[0], eplb.phy2log[0]) if e == 0)
    with pytest.raises(ValueError, match=r"counts must be \[2\]\[4\]"):
        none.imbalance([[1.0, 2.0]])


def test_placement_refuses_inconsistent_arrays():
    good = Placement.contiguous(1, 4, 2)
    with pytest.raises(ValueError, match="do not divide over num_gpus=3"):
        Placement(good.phy2log, good.log2phy, good.logcnt, 3)
    with pytest.raises(ValueError, match="logcnt does not count"):
        Placement(((0, 0, 2, 3),), good.log2phy, good.logcnt, 2)
    with pytest.raises(ValueError, match="log2phy of expert 0"):
        Placement(good.phy2log, (((1,), (0,), (2,), (3,)),), good.logcnt, 2)
    with pytest.raises(ValueError, match="do not divide over 3 GPUs"):
        Placement.contiguous(1, 4, 3)


def shuffled_gpus(placement: Placement, seed: int) -> Placement:
    """The same placement with its GPUs renumbered at random (what EPLB's packing order can do)."""
    rng, per = random.Random(seed), placement.slots_per_gpu
    order = list(range(placement.num_gpus))
    rng.shuffle(order)
    phy2log = tuple(tuple(e for g in order for e in row[g * per:(g + 1) * per]) for row in placement.phy2log)
    log2phy = []
    for row in phy2log:
        slots = [[] for _ in range(placement.num_logical_experts)]
        for s, e in enumerate(row):
            slots[e].append(s)
        width = len(placement.log2phy[0][0])
        log2phy.append(tuple(tuple(s + [-1] * (width - len(s))) for s in slots))
    return Placement(phy2log, tuple(log2phy), placement.logcnt, placement.num_gpus, placement.num_nodes)


def test_alignment_keeps_loads_and_moves_fewer_weights():
    loads = zipf_loads(4, 64, 0.8, seed=5)
    old = Placement.from_loads(loads, 8, 8)
    assert old.aligned_to(old) == old
    # a renumbering alone moves nothing (replica ranks may differ: which copy is "first" does not matter)
    assert shuffled_gpus(old, 1).aligned_to(old).phy2log == old.phy2log
    rng = random.Random(6)
    drifted = [[w * rng.uniform(0.8, 1.25) for w in row] for row in loads]
    raw = Placement.from_loads(drifted, 8, 8)
    aligned = raw.aligned_to(old)
    counts = [[rng.randint(0, 100) for _ in range(64)] for _ in range(4)]
    assert aligned.imbalance(counts) == pytest.approx(raw.imbalance(counts)) and aligned.logcnt == raw.logcnt
    for a, b in zip(aligned.gpu_loads(counts), raw.gpu_loads(counts)):
        assert sorted(a) == pytest.approx(sorted(b))
    moved_raw = sum(map(len, old.changed_slots(raw)))
    moved = sum(map(len, old.changed_slots(aligned)))
    assert moved <= 0.9 * moved_raw  # here 203 of 269; EPLB's packing reshuffles much of a GPU's contents


def test_alignment_renumbers_gpus_only_inside_a_node():
    loads = zipf_loads(2, 32, 1.0, seed=7)
    old = Placement.from_loads(loads, 8, 8, num_groups=4, num_nodes=2)
    new = Placement.from_loads([list(reversed(row)) for row in loads], 8, 8, num_groups=4, num_nodes=2)
    aligned = new.aligned_to(old)
    for a, b in zip(aligned.phy2log, new.phy2log):
        assert sorted(a[:20]) == sorted(b[:20]) and sorted(a[20:]) == sorted(b[20:])
    with pytest.raises(ValueError, match="cannot be aligned"):
        new.aligned_to(Placement.from_loads(loads, 8, 8))
