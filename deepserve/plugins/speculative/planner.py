"""DSpark's verify planner: how many of each sequence's drafts to verify this step (plain Python, no torch).

Every running sequence i brings k_i drafts with confidences c[i][j], the probability that draft j is accepted
given that drafts < j were. Verifying the first L_i drafts yields, in expectation, 1 + sum_{j<L_i} s[i][j]
tokens, where s[i][j] = c[i][0] * ... * c[i][j] is the prefix survival (the 1 is the token the target model
always produces: the correction after a rejection, or the bonus token). A step that verifies T = N + sum_i L_i
tokens (N sequences, one base token each) takes t(T) seconds. The planner chooses the L_i that maximise

    rate(L) = (N + sum_i sum_{j<L_i} s[i][j]) / t(N + sum_i L_i)        (expected tokens per second).

Greedy allocation over the whole batch: order all draft slots by survival, highest first. Survivals never
increase along a sequence (each c <= 1), so every prefix of that order verifies a prefix of each sequence's
drafts, and for a given total M of verified drafts it holds the M largest survivals: it maximises the
numerator among all allocations with that total, and the denominator depends on the total only. The rate of
the best allocation of every total M therefore lies on the greedy order, and the planner takes the M with the
highest rate (the smallest on ties). Stopping at the first slot that lowers the rate would be the same for a
step time that is convex in T; scanning every M also handles step-shaped curves (a GPU wave or a CUDA-graph
bucket boundary), where the rate dips and then recovers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence


def prefix_survivals(confidences: Sequence[float]) -> list[float]:
    """s[j] = c[0] * ... * c[j], with each confidence clamped to [0, 1] (NaN counts as 0)."""
    out, s = [], 1.0
    for c in confidences:
        c = float(c)
        s *= min(max(c, 0.0), 1.0) if c == c else 0.0
        out.append(s)
    return out


def expected_tokens(confidences: Sequence[Sequence[float]], lengths: Sequence[int]) -> float:
    """Expected tokens the step yields: one per sequence plus the survivals of the verified drafts."""
    if len(confidences) != len(lengths):
        raise ValueError(f"{len(confidences)} sequences but {len(lengths)} lengths")
    total = float(len(lengths))
    for c, n in zip(confidences, lengths):
        if not 0 <= n <= len(c):
            raise ValueError(f"verify length {n} outside 0..{len(c)}")
        total += sum(prefix_survivals(c[:n]))
    return total


def expected_rate(confidences: Sequence[Sequence[float]], lengths: Sequence[int],
                  step_time: Callable[[int], float]) -> float:
    """Expected tokens per second of verifying `lengths` (the planner's objective)."""
    return expected_tokens(confidences, lengths) / _time(step_time, len(lengths) + sum(lengths))


def plan_verify_lengths(confidences: Sequence[Sequence[float]], step_time: Callable[[int], float],
                        other_tokens: int = 0, other_outputs: float = 0.0) -> list[int]:
    """DSpark: the verify length of every sequence (0..len(confidences[i])) that maximises expected tokens per
    second, given each sequence's draft confidences and the step time t(T) of a step computing T tokens in all.
    T = `other_tokens` (the step's work besides the drafting sequences: prefill chunks, requests that do not
    draft) + number of drafting sequences + total verified drafts; the step's output is `other_outputs` (tokens
    the other work samples) + one per drafting sequence + the accepted drafts. Exactly optimal for any positive
    t (see the module docstring: both extra terms are constants of the allocation)."""
    num_seqs = len(confidences)
    if num_seqs == 0:
        return []
    if other_tokens < 0 or other_outputs < 0:
        raise ValueError(f"other_tokens and other_outputs must be >= 0, got {other_tokens} and {other_outputs}")
    slots = [(-s, j, i) for i, c in enumerate(confidences) for j, s in enumerate(prefix_survivals(c))]
    slots.sort()  # highest survival first; on ties the earlier draft first, so every prefix is prefix-closed
    base, fixed = other_outputs + num_seqs, other_tokens + num_seqs
    best_m, best_rate, gained = 0, base / _time(step_time, fixed), 0.0
    for m, (neg_s, _, _) in enumerate(slots, start=1):
        gained -= neg_s
        rate = (base + gained) / _time(step_time, fixed + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    lengths = [0] * num_seqs
    for _, _, i in slots[:best_m]:
        lengths[i] += 1
    return lengths


def fixed_k(confidences: Sequence[Sequence[float]], k: int | None = None) -> list[int]:
    """The baseline: verify every draft (or the first `k`), whatever the confidences."""
    if k is not None and k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return [len(c) if k is None else min(k, len(c)) for c in confidences]


def _time(step_time: Callable[[int], float], num_tokens: int) -> float:
    t = float(step_time(num_tokens))
    if not t > 0 or math.isinf(t):
        raise ValueError(f"step time must be positive and finite, got t({num_tokens}) = {t}")
    return t


class StepTimeCurve:
    """The step time t(T) as a function of the tokens T a step computes, fitted online.

    `observe(T, seconds)` folds a measured step into exponential moving averages (of T and of the time) kept per
    bucket of T: exact below 64 tokens, then 16 buckets per doubling, so a few hundred knots cover any step size
    and refitting stays cheap. The curve is the piecewise-linear interpolation of those averages after an
    isotonic (non-decreasing) fit, weighted by how often each bucket was seen: a step never gets cheaper by
    adding tokens, and noise must not invent a dip the planner would chase. Below the smallest observed T the
    curve is flat; above the largest it grows with the least-squares slope of the observed points (never
    negative). Before any observation it is the prior `prior_base + prior_per_token * T`; the default prior is
    flat, so an unmeasured planner verifies every draft with non-zero confidence, like fixed-k.

    The curve only learns the sizes the planner chooses; a caller that wants it to see larger steps again can
    observe an occasional fixed-k step.
    """

    def __init__(self, prior_base: float = 1.0, prior_per_token: float = 0.0, decay: float = 0.9) -> None:
        if not prior_base > 0 or prior_per_token < 0:
            raise ValueError("the prior needs a positive base and a non-negative per-token cost")
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.prior_base, self.prior_per_token, self.decay = prior_base, prior_per_token, decay
        self._weight_cap = 1.0 / (1.0 - decay)  # an average of many steps weighs about as much as 1/(1-decay)
        self._x: dict[int, float] = {}  # per bucket: average T, average seconds, number of observations
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._knots: tuple[list[float], list[float], float] | None = None  # xs, ys, slope beyond the last x

    @property
    def num_observations(self) -> int:
        return sum(self._count.values())

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 0 or not seconds > 0 or math.isinf(seconds):
            raise ValueError(f"bad observation ({num_tokens} tokens, {seconds} s)")
        b = _bucket(num_tokens)
        if b in self._mean:
            self._x[b] = self.decay * self._x[b] + (1 - self.decay) * num_tokens
            self._mean[b] = self.decay * self._mean[b] + (1 - self.decay) * seconds
        else:
            self._x[b], self._mean[b] = float(num_tokens), seconds
        self._count[b] = self._count.get(b, 0) + 1
        self._knots = None

    def __call__(self, num_tokens: int) -> float:
        if not self._mean:
            return self.prior_base + self.prior_per_token * num_tokens
        if self._knots is None:
            self._knots = self._fit()
        xs, ys, slope = self._knots
        if num_tokens <= xs[0]:
            return ys[0]
        if num_tokens >= xs[-1]:
            return ys[-1] + slope * (num_tokens - xs[-1])
        k = bisect.bisect_right(xs, num_tokens)
        x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)

    def _fit(self) -> tuple[list[float], list[float], float]:
        buckets = sorted(self._mean)  # a bucket's average T stays inside it, so these xs are increasing
        xs = [self._x[b] for b in buckets]
        # pool adjacent violators: blocks of [weighted mean, weight, number of points]
        blocks: list[list[float]] = []
        for b in buckets:
            blocks.append([self._mean[b], min(float(self._count[b]), self._weight_cap), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                y2, w2, n2 = blocks.pop()
                y1, w1, n1 = blocks[-1]
                blocks[-1] = [(y1 * w1 + y2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
        ys = [y for y, _, n in blocks for _ in range(int(n))]
        return xs, ys, self._slope(xs, [self._mean[b] for b in buckets])

    def _slope(self, xs: list[float], ys: list[float]) -> float:
        if len(xs) < 2:
            return self.prior_per_token
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx) if sxx > 0 else self.prior_per_token


def _bucket(num_tokens: int) -> int:
    """Exact below 64 tokens, then 16 buckets per doubling (each bucket is keyed by its lowest T)."""
    if num_tokens < 64:
        return num_tokens
    shift = num_tokens.bit_length() - 5
    return (num_tokens >> shift) << shift
