"""SWA bounded replay on V4.1 (`deepserve.model.v41.replay`): a state rebuilt at a page boundary from the exact
compressed rows and the last window x depth tokens continues bit for bit as the cold prefill's; from DeepInfer's
128 tokens (shorter than window x depth on both golden checkpoints) it is approximate, more so from fewer; bad
arguments are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepserve.model.v41 import load_v41
from deepserve.model.v41.replay import BOUNDED_LENGTH, exact_length, replay_state
from test_v41_engine import prompt

GOLDEN = Path(__file__).parent / "golden" / "v41"
BOUNDARY = 256  # two 128-token pages


def continuation_deviation(model, ids, state) -> float:
    """Max |logprob difference| over 8 teacher-forced decode steps from `state` against a cold prefill's."""
    cold = model.make_state()
    model.forward(ids[:BOUNDARY], cold)
    worst = 0.0
    for t in ids[BOUNDARY : BOUNDARY + 8]:
        a = torch.log_softmax(model.forward([t], cold).logits, -1)
        b = torch.log_softmax(model.forward([t], state).logits, -1)
        worst = max(worst, float((a - b).abs().max()))
    return worst


@pytest.fixture(scope="module")
def tiny_b():
    torch.set_num_threads(1)
    return load_v41(GOLDEN / "tiny_b" / "tiny")  # window 16 x 10 layers = 160 < BOUNDARY


def test_a_replay_of_window_x_depth_tokens_is_exact_and_128_is_not(tiny_b):
    ids = prompt(BOUNDARY + 8, seed=1)
    exact = tiny_b.make_state()
    tiny_b.forward(ids[:BOUNDARY], exact)
    assert exact_length(tiny_b.cfg) == 160 < BOUNDARY
    replayed = replay_state(tiny_b, ids, BOUNDARY, exact_length(tiny_b.cfg), exact)
    for r, e in zip(replayed.layers, exact.layers):
        assert torch.equal(r.ring, e.ring), r.spec.layer
    assert replayed.engram_history == exact.engram_history and replayed.num_tokens == BOUNDARY
    assert continuation_deviation(tiny_b, ids, replayed) == 0.0
    bounded = continuation_deviation(tiny_b, ids, replay_state(tiny_b, ids, BOUNDARY, BOUNDED_LENGTH, exact))
    shorter = continuation_deviation(tiny_b, ids, replay_state(tiny_b, ids, BOUNDARY, 32, exact))
    assert 0.0 < bounded < shorter  # a fresh window at the segment's start: approximate, less so when longer


def test_bad_replays_are_refused(tiny_b):
    ids = prompt(BOUNDARY, seed=2)
    exact = tiny_b.make_state()
    tiny_b.forward(ids[:128], exact)
    with pytest.raises(ValueError, match="fewer than the 128 rows before 256"):
        replay_state(tiny_b, ids, BOUNDARY, BOUNDED_LENGTH, exact)
    with pytest.raises(ValueError, match="is odd"):
        replay_state(tiny_b, ids, 127, 64, exact)
    with pytest.raises(ValueError, match="needs the 300 token ids"):
        replay_state(tiny_b, ids, 300, 128, exact)
