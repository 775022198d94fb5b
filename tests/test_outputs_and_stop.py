import random
import subprocess
import sys

import pytest

from deepserve.core.outputs import CompletionOutput, Logprob, RequestOutput, make_logprob_dict
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.stop_checker import (
    StopStringTracker,
    check_stop,
    find_stop_string,
    hold_back_length,
    min_tokens_blocked_ids,
)

EOS = [1]


def test_outputs_use_vllm_field_names():
    lp = make_logprob_dict([7, 3, 7], [-0.5, -0.1, -0.5], [2, 1, 2], decode=lambda t: f"<{t}>")
    assert list(lp) == [7, 3] and lp[7] == Logprob(-0.5, 2, "<7>")
    completion = CompletionOutput(0, "hi", [5, 6], -1.5, [lp, lp], "stop", "###")
    out = RequestOutput("req-0", "p", [0, 4], [None, {4: Logprob(-2.0, 3)}], [completion], finished=True)
    assert out.outputs[0].text == "hi" and out.outputs[0].finished()
    assert out.outputs[0].logprobs[1][3].logprob == -0.1
    assert out.num_cached_tokens == 0 and out.metrics is None
    assert "req-0" in repr(out) and "finish_reason='stop'" in repr(out)


@pytest.mark.parametrize(
    "make",
    [
        lambda: CompletionOutput(0, "", [], finish_reason="done"),
        lambda: CompletionOutput(-1, "", []),
        lambda: Logprob(-1.0, rank=0),
        lambda: RequestOutput("r", None, [1], [{1: Logprob(0.0)}], [], False),
        lambda: RequestOutput("r", None, [1], None, [], False, num_cached_tokens=-1),
    ],
)
def test_output_validation(make):
    with pytest.raises(ValueError):
        make()


def test_check_stop_token_conditions():
    p = SamplingParams(max_tokens=4, stop_token_ids=[9])
    assert check_stop(5, 1, 10, p, EOS, 100) == (None, None)
    assert check_stop(1, 1, 10, p, EOS, 100) == ("stop", None)
    assert check_stop(9, 1, 10, p, EOS, 100) == ("stop", 9)
    assert check_stop(5, 4, 10, p, EOS, 100) == ("length", None)
    assert check_stop(1, 4, 10, p, EOS, 100) == ("stop", None)  # the model ended on its last allowed token
    assert check_stop(5, 2, 100, p, EOS, 100) == ("length", None)  # context full
    assert check_stop(5, 2, 99, SamplingParams(max_tokens=None), EOS, 100) == (None, None)
    assert check_stop(1, 1, 10, SamplingParams(ignore_eos=True), EOS, 100) == (None, None)


def test_min_tokens_defers_eos_and_stop_ids():
    p = SamplingParams(min_tokens=3, stop_token_ids=[9, 4])
    assert check_stop(1, 2, 10, p, EOS, 100) == (None, None)
    assert check_stop(9, 2, 10, p, EOS, 100) == (None, None)
    assert check_stop(9, 3, 10, p, EOS, 100) == ("stop", 9)
    assert min_tokens_blocked_ids(p, EOS, 0) == [1, 4, 9]
    assert min_tokens_blocked_ids(p, EOS, 3) == []
    assert min_tokens_blocked_ids(SamplingParams(min_tokens=2, ignore_eos=True), EOS, 1) == []


def test_stop_string_spanning_deltas():
    tracker = StopStringTracker(["STOP"])
    assert tracker.append("hello ST") is None
    match = tracker.append("OP and more")
    assert match is not None and match.stop == "STOP" and match.text == "hello "
    assert tracker.text == "hello "
    with pytest.raises(RuntimeError):
        tracker.append("x")

    included = StopStringTracker(["STOP"], include_stop_str_in_output=True)
    included.append("hello S")
    assert included.append("TOP!").text == "hello STOP"


def test_first_completed_stop_wins():
    # "bc" completes (at char 3) before "abcd" would (at char 4)
    assert find_stop_string("xabcd", 5, ["abcd", "bc"]).stop == "bc"
    # both complete at the same character: the longer one (starting earlier) is cut
    assert find_stop_string("xabc", 4, ["bc", "abc"]) == find_stop_string("xabc", 4, ["abc", "bc"])
    assert find_stop_string("xabc", 4, ["bc", "abc"]).text == "x"
    # text before the new delta was searched already and is not searched again
    assert find_stop_string("ab|cd", 2, ["ab"]) is None
    assert find_stop_string("abc", 1, ["ab"]) is None


def test_stop_result_is_independent_of_delta_boundaries():
    rng = random.Random(0)
    stops = ["aba", "bb", "cab"]
    for _ in range(300):
        text = "".join(rng.choice("abcx") for _ in range(rng.randint(1, 15)))
        reference = StopStringTracker(stops)
        for ch in text:
            if reference.append(ch):
                break
        tracker, start = StopStringTracker(stops), 0
        while start < len(text) and tracker.match is None:
            end = rng.randint(start + 1, len(text))
            tracker.append(text[start:end])
            start = end
        assert (tracker.text, tracker.match) == (reference.text, reference.match), text


def test_hold_back_length():
    assert hold_back_length("hello", ["###"]) == 0
    assert hold_back_length("hello #", ["###"]) == 1
    assert hold_back_length("hello ##", ["###"]) == 2
    assert hold_back_length("hello ##", ["#x", "###"]) == 2
    assert hold_back_length("ab", ["abc", "b"]) == 2
    assert hold_back_length("", ["abc"]) == 0
    assert hold_back_length("abc", []) == 0


def test_streaming_never_shows_a_stop_string():
    rng = random.Random(1)
    for include in (False, True):
        for _ in range(200):
            text = "".join(rng.choice("ab#") for _ in range(30))
            tracker, streamed = StopStringTracker(["##", "bab"], include), ""
            for ch in text:
                tracker.append(ch)
                streamed += tracker.stream_delta()
                if tracker.match:
                    break
                assert include or ("##" not in streamed and "bab" not in streamed)
            streamed += tracker.stream_delta(final=True)
            assert streamed == tracker.text


def test_core_modules_import_no_torch():
    code = (
        "import sys, deepserve.core.sampling_params, deepserve.core.outputs, deepserve.core.stop_checker; "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torch']"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
