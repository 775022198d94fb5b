"""DSpark's verify planner against brute force over every allocation, its edge cases, and the step-time curve."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from deepserve.plugins.speculative.planner import (
    StepTimeCurve,
    expected_rate,
    expected_tokens,
    fixed_k,
    plan_verify_lengths,
    prefix_survivals,
)

#: step-time shapes t(T), T = tokens verified in the step (>= 1): linear, convex, concave, step-shaped (a kernel
#: wave / graph bucket every 8 tokens), flat-then-linear (memory-bound until 6 tokens), and a steep step.
CURVES = {
    "linear": lambda T: 1.0 + 0.15 * T,
    "convex": lambda T: 1.0 + 0.02 * T * T,
    "concave": lambda T: 0.5 + 0.6 * math.sqrt(T),
    "steps": lambda T: 1.0 + 0.8 * math.ceil(T / 8),
    "flat_then_linear": lambda T: max(1.0, 0.17 * T),
    "steep_step": lambda T: 1.0 if T <= 6 else 2.5 + 0.01 * T,
}


def random_confidences(rng: random.Random) -> list[list[float]]:
    out = []
    for _ in range(rng.randint(2, 4)):
        k = rng.randint(0, 4)
        kind = rng.random()
        if kind < 0.15:
            out.append([rng.choice([0.0, 1.0]) for _ in range(k)])  # degenerate heads and ties
        elif kind < 0.6:
            out.append([rng.random() for _ in range(k)])
        else:
            out.append([1 - rng.random() ** 3 * 0.6 for _ in range(k)])  # confident drafter
    return out


def brute_force_rate(confidences, step_time) -> float:
    cums = [[0.0, *itertools.accumulate(prefix_survivals(c))] for c in confidences]
    N = len(confidences)
    return max((N + sum(cum[n] for cum, n in zip(cums, ls))) / step_time(N + sum(ls))
               for ls in itertools.product(*(range(len(c) + 1) for c in confidences)))


def test_greedy_is_optimal_on_brute_forced_cases():
    """2000 random batches of 2-4 sequences with 0-4 drafts, over every curve shape: the planner's rate equals
    the best allocation's (measured worst ratio 1.0; the bound only allows float rounding)."""
    rng = random.Random(7)
    worst = {name: 1.0 for name in CURVES}
    for case in range(2000):
        name = list(CURVES)[case % len(CURVES)]
        conf = random_confidences(rng)
        lengths = plan_verify_lengths(conf, CURVES[name])
        assert len(lengths) == len(conf) and all(0 <= n <= len(c) for n, c in zip(lengths, conf))
        ratio = expected_rate(conf, lengths, CURVES[name]) / brute_force_rate(conf, CURVES[name])
        worst[name] = min(worst[name], ratio)
    assert min(worst.values()) >= 1 - 1e-12, worst


def test_other_work_in_the_step_is_part_of_the_optimum():
    """Prefill chunks and non-drafting requests share the step: with their tokens in t and their outputs in the
    rate, the planner still matches brute force, and it changes its answer where it should."""
    rng = random.Random(11)
    for case in range(600):
        name = list(CURVES)[case % len(CURVES)]
        other_tokens, other_outputs = rng.randint(0, 40), rng.randint(0, 8)
        conf = random_confidences(rng)
        lengths = plan_verify_lengths(conf, CURVES[name], other_tokens, other_outputs)
        N = len(conf)
        cums = [[0.0, *itertools.accumulate(prefix_survivals(c))] for c in conf]

        def rate(ls):
            return (other_outputs + N + sum(cum[n] for cum, n in zip(cums, ls))) / CURVES[name](other_tokens + N + sum(ls))

        best = max(rate(ls) for ls in itertools.product(*(range(len(c) + 1) for c in conf)))
        assert rate(lengths) >= best * (1 - 1e-12), (name, conf, other_tokens, other_outputs)
    # t(T) = T (every token costs the same): alone, one sequence with survivals .9, .09 verifies nothing (1/1 beats
    # 1.9/2); beside 10 tokens of prefill that sample nothing, a draft is nearly free: 1/11 = .091, 1.9/12 = .158,
    # 1.99/13 = .153 -> verify one
    assert plan_verify_lengths([[0.9, 0.1]], lambda T: float(T)) == [0]
    assert plan_verify_lengths([[0.9, 0.1]], lambda T: float(T), other_tokens=10) == [1]
    with pytest.raises(ValueError, match="other_tokens"):
        plan_verify_lengths([[0.5]], lambda T: 1.0, other_tokens=-1)


def test_verifies_prefixes_of_the_most_confident_sequences_first():
    conf = [[0.95, 0.9, 0.9, 0.85, 0.8], [0.3, 0.2, 0.9, 0.9, 0.9], [0.7, 0.6, 0.5, 0.4, 0.3]]
    lengths = plan_verify_lengths(conf, lambda T: 1.0 + 0.2 * T)
    assert lengths[0] > lengths[2] > lengths[1]
    # survivals in order .95 .855 .770 (seq 0) .70 (seq 2) .654 .523 (seq 0): rates 2.19 2.40 2.53 2.61 2.665,
    # then 2.661 with the sixth slot
    assert lengths == [4, 0, 1]


def test_hand_computed_trade_off():
    # one sequence, survivals 0.9, 0.09; t(T) = T: verifying 0 gives 1/1, 1 gives 1.9/2, 2 gives 1.99/3
    assert plan_verify_lengths([[0.9, 0.1]], lambda T: float(T)) == [0]
    # t(T) = 1 + 0.1 T: 1/1.1 = 0.909, 1.9/1.2 = 1.583, 1.99/1.3 = 1.531 -> verify one
    assert plan_verify_lengths([[0.9, 0.1]], lambda T: 1 + 0.1 * T) == [1]


def test_step_shaped_curve_needs_the_full_scan():
    """t jumps after 2 tokens and is flat after: the first extra draft lowers the rate, the later ones raise it
    past where it was. Stopping at the first loss would verify nothing."""
    def t(T):
        return 1.0 if T <= 2 else 1.5

    conf = [[0.5, 0.9, 0.9, 0.9], [0.1]]
    assert expected_rate(conf, [1, 0], t) < expected_rate(conf, [0, 0], t)
    assert plan_verify_lengths(conf, t) == [4, 1]


def test_flat_curve_verifies_everything_like_fixed_k():
    conf = [[0.9, 0.2, 0.01], [0.5], [], [0.3, 0.3]]
    assert plan_verify_lengths(conf, lambda T: 1.0) == fixed_k(conf) == [3, 1, 0, 2]


def test_edge_cases():
    assert plan_verify_lengths([], lambda T: 1.0) == []
    assert plan_verify_lengths([[], []], lambda T: 1.0 + T) == [0, 0]
    assert plan_verify_lengths([[0.0, 0.0], [0.0]], lambda T: 1.0) == [0, 0]  # nothing to gain: no extra work
    assert plan_verify_lengths([[0.0, 1.0], [1.0, 1.0]], lambda T: 1.0 + 0.01 * T) == [0, 2]
    assert plan_verify_lengths([[1.5, float("nan"), 0.9]], lambda T: 1.0) == [1]  # clamped; NaN counts as 0
    with pytest.raises(ValueError, match="positive"):
        plan_verify_lengths([[0.5]], lambda T: 0.0)


def test_fixed_k_and_expected_tokens():
    conf = [[0.5, 0.5, 0.5], [0.9], []]
    assert fixed_k(conf, 2) == [2, 1, 0] and fixed_k(conf, 0) == [0, 0, 0]
    assert expected_tokens(conf, [2, 1, 0]) == pytest.approx(3 + 0.5 + 0.25 + 0.9)
    with pytest.raises(ValueError):
        expected_tokens(conf, [4, 0, 0])
    with pytest.raises(ValueError):
        fixed_k(conf, -1)


def test_curve_prior_before_observations():
    assert StepTimeCurve()(10) == StepTimeCurve()(500) == 1.0
    assert StepTimeCurve(prior_base=2.0, prior_per_token=0.5)(4) == 4.0
    assert StepTimeCurve().num_observations == 0


def test_curve_learns_a_noisy_linear_step_time():
    rng = random.Random(0)
    curve = StepTimeCurve()
    for _ in range(5000):
        T = rng.randint(16, 4000)  # thousands of distinct sizes, kept in a few hundred buckets
        curve.observe(T, (0.010 + 0.00001 * T) * (1 + 0.1 * (rng.random() - 0.5)))
    for T in (16, 50, 200, 401, 3000, 3999):
        assert curve(T) == pytest.approx(0.010 + 0.00001 * T, rel=0.03)
    assert curve(8000) == pytest.approx(0.010 + 0.00001 * 8000, rel=0.05)  # extrapolated with the fitted slope
    assert curve(1) == curve(16)  # flat below what was seen


def test_curve_is_monotone_whatever_the_noise():
    rng = random.Random(1)
    curve = StepTimeCurve(decay=0.5)
    for _ in range(400):
        T = rng.randint(1, 60)
        curve.observe(T, 1.0 + 0.01 * T + rng.random())
    values = [curve(T) for T in range(0, 120)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    curve.observe(70, 0.5)  # a fast outlier at the far end is pooled with its neighbours, never a dip
    assert all(curve(T + 1) >= curve(T) for T in range(0, 120))


def test_planner_with_a_fitted_step_curve_matches_the_true_curve():
    """Fed measurements of a step-shaped device, the fitted curve makes the planner's choices as good as
    planning with the true curve (within 2% of the optimum rate on every batch)."""
    def true_t(T):
        return 0.02 + 0.004 * math.ceil(T / 32)

    rng = random.Random(3)
    curve = StepTimeCurve()
    for _ in range(2000):
        T = rng.randint(8, 600)
        curve.observe(T, true_t(T) * (1 + 0.02 * (rng.random() - 0.5)))
    for _ in range(50):
        conf = [[rng.random() ** 0.3 for _ in range(5)] for _ in range(rng.randint(8, 96))]
        ours = expected_rate(conf, plan_verify_lengths(conf, curve), true_t)
        best = expected_rate(conf, plan_verify_lengths(conf, true_t), true_t)
        assert ours >= 0.98 * best


def test_curve_rejects_bad_observations():
    curve = StepTimeCurve()
    with pytest.raises(ValueError):
        curve.observe(4, 0.0)
    with pytest.raises(ValueError):
        curve.observe(-1, 1.0)
    with pytest.raises(ValueError):
        StepTimeCurve(decay=1.0)
