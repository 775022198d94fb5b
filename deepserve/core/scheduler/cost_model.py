"""`StepCostModel`: a step's time as a function of the prefill work in it, fitted online; it sizes prefill chunks.

The model. One chunk of `n` new tokens for a sequence whose first `p` tokens are already computed costs
`b*n + c*n*p + d*n*n`, and every step costs `a` once (launches, sampling, host work). A step with several chunks
adds their features up: `t = a + b*sum(n) + c*sum(n*p) + d*sum(n*n)`.

Why quadratic. The linear term is everything done per token (projections, MoE experts, norms). Attention is not:
each of the `n` new tokens attends to the `p` cached ones (`n*p`) and, causally, to the new tokens before it
(about `n*n/2`). Long prompts make those two terms dominate, so a fixed chunk size is either too small for short
prefixes or blows the step time for long ones. Decode tokens fit the same form as chunks with `n = 1` (and a
verify of `k` drafts as `n = k + 1`).

How the scheduler uses it. While planning a step it calls `largest_chunk(p, remaining, time_left, cap,
other_chunks)` for each prefill it continues, with the chunks already planned for the step as `other_chunks`;
the answer is the largest chunk whose predicted step time fits, capped at 32,768 tokens (DeepSeek's budget) and
never below 1 token, so every prefill makes progress. After the device runs the step, the engine calls
`observe(chunks, seconds)` with the measured time. The fit is ordinary least squares, constrained to
non-negative coefficients, over the last `window` steps, so it follows the hardware as it drifts; until the
window holds `min_observations` distinct steps (or whenever the data cannot tell the terms apart) the prior
coefficients from the config are used instead.

Plain Python: no numpy, no torch. The 4x4 normal equations are solved by Gaussian elimination.
"""

from __future__ import annotations

import math
import operator
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

#: a chunk of prefill work: (n new tokens, p tokens of the sequence already computed)
Chunk = tuple[int, int]
#: the per-step token budget DeepSeek's deployment uses
DEEPSEEK_MAX_CHUNK = 32_768
#: predictions never go below this, so no step is ever predicted to be free
MIN_STEP_SECONDS = 1e-6
#: Gaussian-elimination pivots below this (the normal equations are scaled to a unit diagonal) mean the
#: observed steps cannot tell two terms apart, e.g. every chunk had the same prefix length
_SINGULAR_PIVOT = 1e-10
_NUM_TERMS = 4  # a, b, c, d

Features = tuple[int, int, int, int]  # (1, sum n, sum n*p, sum n*n): exact ints


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _seconds(name: str, value: Any, allow_negative: bool = False) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    try:
        value = float(value)  # numpy scalars and 0-d tensors convert too
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(value) or (value < 0 and not allow_negative):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """`t(n, p) = a + b*n + c*n*p + d*n*n`, in seconds; all four are finite and >= 0."""

    a: float
    b: float
    c: float
    d: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.a, self.b, self.c, self.d)


#: Order-of-magnitude guesses for one prefill GPU, used only until real steps have been measured: 5 ms per step,
#: 25,000 tokens/s of per-token work, attention over a 64K prefix doubling a token's cost (c = b / 65,536), and
#: the causal n*n term at half that rate because a token sees on average half of its own chunk.
DEFAULT_PRIOR = CostCoefficients(a=5e-3, b=4e-5, c=6e-10, d=3e-10)


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    """How prefill chunks are sized.

    `step_time_target`: the step time chunks are sized to, in seconds. `max_chunk`: the most tokens one chunk may
    take. `window`: how many recent steps the fit uses. `min_observations`: distinct steps needed before the fit
    replaces `prior`. `ridge`: added to the (unit) diagonal of the normal equations, for numerical stability only.
    """

    step_time_target: float = 0.5
    max_chunk: int = DEEPSEEK_MAX_CHUNK
    window: int = 512
    min_observations: int = 8
    ridge: float = 1e-12
    prior: CostCoefficients = field(default=DEFAULT_PRIOR)

    def __post_init__(self) -> None:
        target = _seconds("step_time_target", self.step_time_target)
        if target == 0:
            raise ValueError("step_time_target must be > 0 seconds, got 0.0")
        object.__setattr__(self, "step_time_target", target)
        object.__setattr__(self, "max_chunk", _count("max_chunk", self.max_chunk, 1))
        # four coefficients need at least four distinct steps to be determined
        object.__setattr__(self, "min_observations", _count("min_observations", self.min_observations, _NUM_TERMS))
        object.__setattr__(self, "window", _count("window", self.window, self.min_observations))
        object.__setattr__(self, "ridge", _seconds("ridge", self.ridge))
        if not isinstance(self.prior, CostCoefficients):
            raise ValueError(f"prior must be CostCoefficients, got {self.prior!r}")


def _features(chunks: Iterable[Chunk]) -> Features:
    sum_n = sum_np = sum_nn = 0
    for n, p in chunks:
        if type(n) is not int or type(p) is not int or n < 1 or p < 0:  # (checked per chunk per step: plain ints
            n, p = _count("n", n, 1), _count("p", p, 0)                  # pass at once, the rest named or taken)
        sum_n, sum_np, sum_nn = sum_n + n, sum_np + n * p, sum_nn + n * n
    return (1, sum_n, sum_np, sum_nn)


def _step_time(k: tuple[float, float, float, float], x: Features) -> float:
    return max(MIN_STEP_SECONDS, k[0] * x[0] + k[1] * x[1] + k[2] * x[2] + k[3] * x[3])


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when a pivot is (numerically) zero."""
    size = len(rhs)
    rows = [row[:] + [value] for row, value in zip(matrix, rhs)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < _SINGULAR_PIVOT:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, size + 1):
                rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * size
    for r in reversed(range(size)):
        tail = sum(rows[r][c] * solution[c] for c in range(r + 1, size))
        solution[r] = (rows[r][size] - tail) / rows[r][r]
    return solution


def _nonnegative_least_squares(gram: list[list[float]], moment: list[float]) -> list[float] | None:
    """Minimise |X k - y|^2 over k >= 0, given X'X and X'y; None when X'X is singular.

    With four unknowns this is exact by enumeration: the optimum's non-zero terms solve the unconstrained
    problem restricted to them, so it is the best of the subsets whose restricted solution is non-negative.
    """
    terms = range(len(moment))
    best, best_loss = None, math.inf
    for size in range(len(moment), 0, -1):
        for subset in combinations(terms, size):
            solution = _solve([[gram[i][j] for j in subset] for i in subset], [moment[i] for i in subset])
            if solution is None:
                if size == len(moment):
                    return None  # the data cannot tell the terms apart: do not trust any fit
                continue
            if min(solution) < 0:
                continue
            k = [0.0] * len(moment)
            for i, value in zip(subset, solution):
                k[i] = value
            # |Xk - y|^2 up to the constant |y|^2
            loss = sum(k[i] * (sum(gram[i][j] * k[j] for j in terms) - 2 * moment[i]) for i in terms)
            if loss < best_loss:
                best, best_loss = k, loss
    return best


class StepCostModel:
    """Predicts a step's time from its prefill chunks and sizes the next chunk; fitted online from measured steps.

    `observe` records a measured step; `predict` and `largest_chunk` use the current coefficients, refitting
    lazily (at most once per new observation). `coefficients` are the fitted ones once the window holds
    `config.min_observations` distinct steps and they determine every term seen, else `config.prior`. Terms the
    window never exercised (say `c` while every chunk started at p = 0) keep their prior value.
    """

    def __init__(self, config: CostModelConfig | None = None) -> None:
        self.config = config if config is not None else CostModelConfig()
        self._window: deque[tuple[Features, float]] = deque()
        self._distinct: Counter[Features] = Counter()
        # X'X over the window, in exact ints, so dropping old steps never accumulates rounding
        self._gram = [[0] * _NUM_TERMS for _ in range(_NUM_TERMS)]
        self._coefficients = self.config.prior
        self._fitted = False
        self._stale = False

    @property
    def num_observations(self) -> int:
        """Steps in the window (at most `config.window`)."""
        return len(self._window)

    @property
    def coefficients(self) -> CostCoefficients:
        """The coefficients in use: fitted from the window, or the prior (see the class docstring)."""
        if self._stale:
            self._refit()
        return self._coefficients

    @property
    def is_fitted(self) -> bool:
        """True when `coefficients` come from measured steps rather than the prior."""
        if self._stale:
            self._refit()
        return self._fitted

    def observe(self, chunks: Sequence[Chunk], seconds: float) -> None:
        """Record that a step with these chunks took `seconds`; the oldest step leaves a full window."""
        x, seconds = _features(chunks), _seconds("seconds", seconds)
        if len(self._window) == self.config.window:
            self._update_sums(self._window.popleft()[0], sign=-1)
        self._window.append((x, seconds))
        self._update_sums(x, sign=1)
        self._stale = True

    def predict(self, chunks: Sequence[Chunk]) -> float:
        """Predicted seconds for a step with these chunks (at least `MIN_STEP_SECONDS`)."""
        return _step_time(self.coefficients.as_tuple(), _features(chunks))

    def largest_chunk(
        self,
        p: int,
        remaining: int,
        time_left: float | None = None,
        cap: int | None = None,
        other_chunks: Sequence[Chunk] = (),
    ) -> int:
        """The largest chunk of a sequence with `p` tokens computed and `remaining` still to prefill that fits.

        Fits means: a step holding `other_chunks` and this chunk is predicted to take at most `time_left` seconds
        (default `config.step_time_target`). The chunk is at most `remaining`, `config.max_chunk` and `cap` (e.g.
        the step's token budget left), and at least 1 even when nothing fits, so the sequence always advances.
        """
        p, remaining = _count("p", p, 0), _count("remaining", remaining, 1)
        time_left = self.config.step_time_target if time_left is None else _seconds("time_left", time_left, True)
        limit = min(remaining, self.config.max_chunk)
        if cap is not None:
            limit = min(limit, _count("cap", cap, 1))
        k = self.coefficients.as_tuple()
        _, sum_n, sum_np, sum_nn = _features(other_chunks)

        def fits(n: int) -> bool:  # the same integer features and float sum as predict(), so the two agree exactly
            return _step_time(k, (1, sum_n + n, sum_np + n * p, sum_nn + n * n)) <= time_left

        # coefficients are >= 0, so the step time grows with n and the feasible chunks are 1..answer
        low, high = 1, limit
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low

    def _update_sums(self, x: Features, sign: int) -> None:
        self._distinct[x] += sign
        if not self._distinct[x]:
            del self._distinct[x]
        for i in range(_NUM_TERMS):
            for j in range(_NUM_TERMS):
                self._gram[i][j] += sign * x[i] * x[j]

    def _refit(self) -> None:
        self._stale = False
        self._coefficients, self._fitted = self.config.prior, False
        if len(self._distinct) < self.config.min_observations:
            return
        prior = self.config.prior.as_tuple()
        # Terms every step had zero of (no prefix yet, say) are unobserved: they keep the prior and are left out.
        seen = [i for i in range(_NUM_TERMS) if self._gram[i][i] > 0]
        # Scale to a unit diagonal: raw features run from 1 to ~1e10 and would ruin the pivots.
        scale = [math.sqrt(self._gram[i][i]) for i in seen]
        gram = [[self._gram[i][j] / (si * sj) for j, sj in zip(seen, scale)] for i, si in zip(seen, scale)]
        for row in range(len(seen)):
            gram[row][row] += self.config.ridge
        moment = [math.fsum(x[i] * y for x, y in self._window) / s for i, s in zip(seen, scale)]
        solution = _nonnegative_least_squares(gram, moment)
        if solution is None:
            return
        k = list(prior)
        for i, s, value in zip(seen, scale, solution):
            k[i] = value / s
        self._coefficients, self._fitted = CostCoefficients(*k), True
