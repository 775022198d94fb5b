import pytest

from deepserve.core.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy


def test_normalization():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(temperature=1e-7).temperature == 0.0  # below vLLM's epsilon: greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(top_k=1), dict(temperature=0.5, top_k=1)])
def test_greedy(kwargs):
    assert SamplingParams(**kwargs).greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("n", 0),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("max_tokens", -3),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -2),
        ("seed", 1.5),
        ("seed", 2**64),
        ("stop", 42),
        ("stop", ["ok", 3]),
        ("stop", [""]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 7),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", None),
    ],
)
def test_validation_errors_name_field_and_value(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message
    shown = value[-1] if isinstance(value, list) else value
    assert repr(shown) in message or str(shown) in message


def test_n_other_than_one_is_explained():
    with pytest.raises(ValueError, match="n=3 is not supported"):
        SamplingParams(n=3)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens \(8\).*max_tokens \(4\)"):
        SamplingParams(min_tokens=8, max_tokens=4)
    assert SamplingParams(min_tokens=8, max_tokens=None).min_tokens == 8


def test_booleans_are_not_ints():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[True])
