"""The step cost model: it recovers known coefficients from synthetic step times and sizes the largest chunk."""

import math
import random

import pytest

from deepserve.core.scheduler import DEFAULT_PRIOR, MIN_STEP_SECONDS, CostCoefficients, CostModelConfig, StepCostModel

TRUE = CostCoefficients(a=2e-3, b=3e-5, c=4e-10, d=2e-10)


def step_time(k, chunks):
    return k.a + sum(k.b * n + k.c * n * p + k.d * n * n for n, p in chunks)


def make_steps(rng, count, max_chunks=3):
    """Steps of 1..max_chunks chunks; sizes log-uniform so small steps (where `a` shows) are common."""

    def size(high):
        return int(math.exp(rng.uniform(0, math.log(high))))

    return [
        [(size(32_768), rng.choice([0, size(200_000)])) for _ in range(rng.randint(1, max_chunks))]
        for _ in range(count)
    ]


def fitted_model(k, steps, noise=0.0, rng=None, **config):
    model = StepCostModel(CostModelConfig(**config))
    for chunks in steps:
        model.observe(chunks, step_time(k, chunks) + (rng.gauss(0, noise) if noise else 0.0))
    return model


def assert_close(got, want, rel):
    for name, g, w in zip("abcd", got.as_tuple(), want.as_tuple()):
        assert g == pytest.approx(w, rel=rel), name


@pytest.mark.parametrize("max_chunks", [1, 4])
def test_exact_timings_recover_the_coefficients(max_chunks):
    model = fitted_model(TRUE, make_steps(random.Random(0), 300, max_chunks))
    assert model.is_fitted
    assert_close(model.coefficients, TRUE, rel=1e-6)


def test_noisy_timings_recover_the_coefficients_within_a_few_percent():
    rng = random.Random(1)
    model = fitted_model(TRUE, make_steps(rng, 512), noise=2e-4, rng=rng)  # 0.2 ms of jitter: 10% of `a`
    assert_close(model.coefficients, TRUE, rel=0.03)
    chunks = [(8192, 50_000), (1, 3000)]
    assert model.predict(chunks) == pytest.approx(step_time(TRUE, chunks), rel=0.01)


def test_prior_is_used_until_enough_distinct_steps():
    model = StepCostModel()
    assert model.coefficients == DEFAULT_PRIOR and not model.is_fitted
    assert model.predict([(1000, 500)]) == pytest.approx(step_time(DEFAULT_PRIOR, [(1000, 500)]))
    steps = make_steps(random.Random(2), 8)
    for chunks in steps[:7]:
        model.observe(chunks, step_time(TRUE, chunks))
    assert model.coefficients == DEFAULT_PRIOR and not model.is_fitted
    model.observe(steps[7], step_time(TRUE, steps[7]))
    assert model.is_fitted
    assert_close(model.coefficients, TRUE, rel=1e-6)


def test_custom_prior():
    prior = CostCoefficients(a=1e-3, b=1e-4, c=0.0, d=0.0)
    model = StepCostModel(CostModelConfig(prior=prior))
    assert model.predict([(100, 7)]) == pytest.approx(1e-3 + 1e-2)


def test_identical_steps_fall_back_to_the_prior():
    model = StepCostModel()
    for _ in range(100):
        model.observe([(512, 1024)], 0.01)
    assert model.coefficients == DEFAULT_PRIOR and not model.is_fitted
    assert model.largest_chunk(p=0, remaining=10_000) >= 1


def test_terms_the_data_cannot_separate_fall_back_to_the_prior():
    # every chunk has the same prefix, so `b*n` and `c*n*p` move together
    model = fitted_model(TRUE, [[(n, 1000)] for n in range(100, 4000, 100)])
    assert model.coefficients == DEFAULT_PRIOR and not model.is_fitted


def test_unexercised_term_keeps_its_prior_value():
    # no chunk ever had a prefix: a, b and d are fitted, c stays at the prior
    model = fitted_model(TRUE, [[(n, 0)] for n in range(100, 4000, 100)])
    got = model.coefficients
    assert model.is_fitted and got.c == DEFAULT_PRIOR.c
    assert (got.a, got.b, got.d) == pytest.approx((TRUE.a, TRUE.b, TRUE.d), rel=1e-6)


def test_window_forgets_an_old_regime():
    rng = random.Random(3)
    slower = CostCoefficients(a=4e-3, b=5e-5, c=1e-9, d=1e-10)
    model = fitted_model(TRUE, make_steps(rng, 64), window=64)
    assert_close(model.coefficients, TRUE, rel=1e-6)
    for chunks in make_steps(rng, 32):
        model.observe(chunks, step_time(slower, chunks))
    assert model.num_observations == 64
    assert model.coefficients.b != pytest.approx(TRUE.b, rel=1e-3)  # half old, half new: neither
    for chunks in make_steps(rng, 32):
        model.observe(chunks, step_time(slower, chunks))
    assert_close(model.coefficients, slower, rel=1e-6)


def test_coefficients_stay_non_negative():
    rng = random.Random(4)
    no_quadratic = CostCoefficients(a=1e-3, b=3e-5, c=0.0, d=0.0)
    model = fitted_model(no_quadratic, make_steps(rng, 512), noise=2e-4, rng=rng)
    assert model.is_fitted and min(model.coefficients.as_tuple()) >= 0.0
    chunks = [(4096, 4096)]
    assert model.predict(chunks) == pytest.approx(step_time(no_quadratic, chunks), rel=0.01)
    sizes = [model.largest_chunk(p=4096, remaining=32_768, time_left=t) for t in (0.01, 0.1, 0.3, 1.0)]
    assert sizes == sorted(sizes)


def test_predictions_have_a_floor():
    model = StepCostModel(CostModelConfig(prior=CostCoefficients(0.0, 0.0, 0.0, 0.0)))
    assert model.predict([]) == MIN_STEP_SECONDS


@pytest.mark.parametrize("p", [0, 1000, 100_000])
@pytest.mark.parametrize("time_left", [0.1, 0.3, 1.2])
def test_largest_chunk_is_the_largest_that_fits(p, time_left):
    model = fitted_model(TRUE, make_steps(random.Random(5), 64))
    others = [(1, 5000)] * 16 + [(2048, 0)]
    n = model.largest_chunk(p=p, remaining=10**6, time_left=time_left, cap=10**6, other_chunks=others)
    assert 1 < n < 32_768  # the time decides, not a limit
    assert model.predict(others + [(n, p)]) <= time_left < model.predict(others + [(n + 1, p)])


def test_largest_chunk_respects_the_limits():
    model = StepCostModel(CostModelConfig(step_time_target=100.0))  # everything fits: the limits decide
    assert model.largest_chunk(p=0, remaining=10**6) == 32_768
    assert model.largest_chunk(p=0, remaining=10**6, cap=1000) == 1000
    assert model.largest_chunk(p=0, remaining=10**6, cap=10**6) == 32_768  # a cap never lifts max_chunk
    assert model.largest_chunk(p=0, remaining=77) == 77
    assert StepCostModel(CostModelConfig(max_chunk=4096)).largest_chunk(p=0, remaining=10**6, time_left=100.0) == 4096


def test_largest_chunk_defaults_to_the_step_time_target():
    model = StepCostModel(CostModelConfig(step_time_target=0.2))
    n = model.largest_chunk(p=0, remaining=10**6)
    assert model.predict([(n, 0)]) <= 0.2 < model.predict([(n + 1, 0)])


@pytest.mark.parametrize("time_left", [0.0, 1e-4, -1.0])
def test_largest_chunk_is_at_least_one(time_left):
    model = StepCostModel()  # the prior's fixed cost alone is 5 ms
    assert model.largest_chunk(p=10**6, remaining=500, time_left=time_left) == 1
    assert model.largest_chunk(p=0, remaining=500, time_left=10.0, other_chunks=[(32_768, 10**6)]) == 1


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda m: m.observe([(10, 0)], -0.1), "seconds"),
        (lambda m: m.observe([(10, 0)], float("nan")), "seconds"),
        (lambda m: m.observe([(10, 0)], "fast"), "seconds"),
        (lambda m: m.observe([(0, 0)], 0.1), "n"),
        (lambda m: m.observe([(-3, 0)], 0.1), "n"),
        (lambda m: m.observe([(10, -1)], 0.1), "p"),
        (lambda m: m.predict([(1.5, 0)]), "n"),
        (lambda m: m.largest_chunk(p=-1, remaining=10, time_left=1.0), "p"),
        (lambda m: m.largest_chunk(p=0, remaining=0, time_left=1.0), "remaining"),
        (lambda m: m.largest_chunk(p=0, remaining=10, time_left=1.0, cap=0), "cap"),
        (lambda m: m.largest_chunk(p=0, remaining=10, time_left=float("inf")), "time_left"),
        (lambda m: m.largest_chunk(p=0, remaining=10, time_left=1.0, other_chunks=[(0, 1)]), "n"),
    ],
)
def test_invalid_arguments_name_the_argument(call, name):
    model = StepCostModel()
    with pytest.raises(ValueError, match=rf"^{name} "):
        call(model)
    assert model.num_observations == 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(step_time_target=0.0), "step_time_target"),
        (dict(step_time_target=-1.0), "step_time_target"),
        (dict(max_chunk=0), "max_chunk"),
        (dict(window=4), "window"),  # smaller than min_observations
        (dict(min_observations=3), "min_observations"),
        (dict(ridge=-1e-9), "ridge"),
        (dict(prior=(1e-3, 0, 0, 0)), "prior"),
    ],
)
def test_invalid_config_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        CostModelConfig(**kwargs)


def test_negative_prior_coefficient_is_rejected():
    with pytest.raises(ValueError, match=r"^c "):
        CostCoefficients(a=1e-3, b=1e-5, c=-1e-9, d=0.0)
