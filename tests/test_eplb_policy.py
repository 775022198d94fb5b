"""`ExpertLoadBalancer`: which steps' counts a reassignment reads, when it runs, what it reports, and the calls the
rank loop is held to."""

from __future__ import annotations

import random

import pytest

from deepserve.core.balance import EplbConfig, ExpertLoadBalancer, Placement


def hot_counts(num_layers: int, num_experts: int, hot: int, heat: float = 50.0) -> list[list[float]]:
    """Every layer: one token per expert, `heat` tokens on expert `hot`."""
    return [[heat if e == hot else 1.0 for e in range(num_experts)] for _ in range(num_layers)]


def replicated(placement: Placement) -> set[int]:
    return {e for e, c in enumerate(placement.logcnt[0]) if c > 1}


def test_presets_are_deepinfers_settings():
    assert EplbConfig.prefill() == EplbConfig() == EplbConfig(100, 1000, 4)
    assert EplbConfig.decode() == EplbConfig(window_size=1000, step_interval=10_000, redundant_experts_per_gpu=1)
    for bad in ({"window_size": 0}, {"step_interval": 1.5}, {"redundant_experts_per_gpu": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EplbConfig(**bad)


def test_reassignment_reads_only_its_window():
    # window 3, every 10 steps: steps 8..10 are hot on expert 5, earlier steps on expert 2
    balancer = ExpertLoadBalancer(EplbConfig(3, 10, 1), num_layers=2, num_experts=8, num_gpus=2)
    wanted = []
    for step in range(1, 11):
        wanted.append(balancer.needs_counts)
        new = balancer.observe(hot_counts(2, 8, 5 if step >= 8 else 2))
        assert (new is not None) == (step == 10)
    assert wanted == [False] * 7 + [True] * 3
    assert replicated(new) == {5} and balancer.placement is new and balancer.num_rebalances == 1
    report = balancer.last_rebalance
    assert report.step == 10 and report.num_moved_slots > 0
    assert all(after < before for before, after in zip(report.imbalance_before, report.imbalance_after))
    assert report.imbalance_after == tuple(new.imbalance([[3 * v for v in row] for row in hot_counts(2, 8, 5)]))


def test_steps_outside_the_windows_need_no_counts():
    balancer = ExpertLoadBalancer(EplbConfig(2, 5, 1), num_layers=1, num_experts=4, num_gpus=2)
    assert balancer.max_steps_per_observe == 3  # up to the start of the first window
    assert balancer.observe(None, num_steps=3) is None
    with pytest.raises(ValueError, match="their counts are needed"):
        balancer.observe(None)
    with pytest.raises(ValueError, match="at most 2 steps"):
        balancer.observe(hot_counts(1, 4, 0), num_steps=3)
    new = balancer.observe(hot_counts(1, 4, 3), num_steps=2)  # steps 4..5, summed on the device
    assert new is not None and replicated(new) == {3} and balancer.step == 5
    assert balancer.next_rebalance_step == 10 and not balancer.needs_counts


def test_chunked_counts_give_the_same_placements_as_per_step():
    rng = random.Random(0)
    steps = [[[rng.randint(0, 20) * (1 + 5 * (e == s // 7 % 6)) for e in range(6)] for _ in range(3)]
             for s in range(60)]
    config = EplbConfig(window_size=8, step_interval=20, redundant_experts_per_gpu=1)
    per_step = ExpertLoadBalancer(config, 3, 6, 2)
    placements = [p for counts in steps if (p := per_step.observe(counts)) is not None]
    chunked, chunk_placements, i = ExpertLoadBalancer(config, 3, 6, 2), [], 0
    while i < len(steps):
        n = min(chunked.max_steps_per_observe, 5)
        counts = None
        if chunked.needs_counts:
            counts = [[sum(steps[j][layer][e] for j in range(i, i + n)) for e in range(6)] for layer in range(3)]
        if (p := chunked.observe(counts, n)) is not None:
            chunk_placements.append(p)
        i += n
    assert chunk_placements == placements and len(placements) >= 2


def test_windows_longer_than_the_interval_overlap():
    """window 7 every 3 steps: each reassignment sums exactly its last 7 steps (checked against the history)."""
    rng = random.Random(1)
    config = EplbConfig(window_size=7, step_interval=3, redundant_experts_per_gpu=2)
    balancer, history = ExpertLoadBalancer(config, 2, 4, 2), []
    for step in range(1, 31):
        counts = [[rng.randint(0, 9) * (3 if e == step % 4 else 1) for e in range(4)] for _ in range(2)]
        history.append(counts)
        old = balancer.placement
        balancer.observe(counts)
        if step % 3 == 0:
            window = [[sum(h[layer][e] for h in history[-7:]) for e in range(4)] for layer in range(2)]
            expected = Placement.from_loads(window, 2, 4).aligned_to(old)
            report = balancer.last_rebalance
            assert report.step == step and report.imbalance_before == tuple(old.imbalance(window))
            assert report.imbalance_after == tuple(expected.imbalance(window))
            if report.num_moved_slots:
                assert balancer.placement == expected
    assert len(balancer._stretches) <= 4  # merged stretches, not one bucket per step


def test_an_idle_window_keeps_the_placement():
    balancer = ExpertLoadBalancer(EplbConfig(2, 4, 1), num_layers=1, num_experts=4, num_gpus=2)
    start = balancer.placement
    for _ in range(4):
        assert balancer.observe([[0, 0, 0, 0]]) is None
    assert balancer.placement is start and balancer.last_rebalance.num_moved_slots == 0


def test_latest_imbalance_is_the_gauge_for_metrics():
    initial = Placement.contiguous(2, 4, 2)
    balancer = ExpertLoadBalancer(EplbConfig(2, 100, 0), num_layers=2, num_experts=4, num_gpus=2,
                                  initial=initial)
    assert balancer.latest_imbalance() is None
    balancer.observe([[3, 1, 1, 1], [1, 1, 1, 1]])
    assert balancer.latest_imbalance() == pytest.approx([4 / 3, 1.0])  # GPU loads 4 and 2


def test_bad_calls_are_named():
    balancer = ExpertLoadBalancer(EplbConfig(2, 4, 1), num_layers=2, num_experts=4, num_gpus=2)
    with pytest.raises(ValueError, match=r"counts must be \[2\]\[4\]"):
        balancer.observe([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        balancer.observe(None, num_steps=0)
    with pytest.raises(ValueError, match="initial placement is 1 layers"):
        ExpertLoadBalancer(EplbConfig(), 2, 4, 2, initial=Placement.contiguous(1, 4, 2))
    with pytest.raises(ValueError, match="not a multiple of num_gpus"):
        ExpertLoadBalancer(EplbConfig(redundant_experts_per_gpu=1), 2, 5, 2)


def test_utilization_threshold_keeps_balanced_layers():
    # layer 0 stays balanced under the start placement, layer 1 gets one hot expert
    config = EplbConfig(2, 4, 1, min_rebalancing_utilization_threshold=0.9)
    balancer = ExpertLoadBalancer(config, num_layers=2, num_experts=4, num_gpus=2)
    start = balancer.placement
    even = start.logical_counts([[10.0] * 6] * 2)[0]  # 10 tokens per slot: every GPU equal under `start`
    for _ in range(4):
        new = balancer.observe([even, [40.0, 1.0, 1.0, 1.0]])
    report = balancer.last_rebalance
    assert report.imbalance_before[0] == pytest.approx(1.0) and report.imbalance_before[1] > 1 / 0.9
    assert new is not None and new.phy2log[0] == start.phy2log[0] and new.phy2log[1] != start.phy2log[1]
    assert report.moved_slots[0] == () and report.moved_slots[1]
    assert balancer.placement.logcnt[1] == (3, 1, 1, 1) and report.imbalance_after[1] < report.imbalance_before[1]
    with pytest.raises(ValueError, match="min_rebalancing_utilization_threshold must be in"):
        EplbConfig(min_rebalancing_utilization_threshold=1.5)
