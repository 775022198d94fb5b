"""The MTP block: loads with the checkpoint, runs batched and incrementally over its own window state."""

from __future__ import annotations

import pytest
import torch

import tiny

from deepserve.model.batch import make_batch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.demo_model(tmp_path_factory, seed=3)


def tokens(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 258, (n,), generator=g).tolist()


@torch.no_grad()
def main_streams(model, ids):
    state = model.make_state()
    out = model(make_batch([ids], [0], "cpu", logits_rows=[range(len(ids))]), [state])
    return state, out.streams


@torch.no_grad()
def mtp_logits(model, ids, sizes):
    """V3 alignment: row i pairs the main streams at i with token i+1 and predicts token i+2."""
    state, streams = main_streams(model, ids)
    pos, out = 0, []
    for n in sizes:
        nxt = ids[pos + 1 : pos + 1 + n]
        batch = make_batch([nxt], [pos], "cpu", logits_rows=[range(n)])
        out.append(model.mtp_forward(0, batch, [state], streams[pos : pos + n]).logits)
        pos += n
    assert state.mtp_num_tokens == pos
    return torch.cat(out)


def test_mtp_block_is_loaded(model):
    assert len(model.mtp) == 1
    assert model.mtp[0].e_proj.weight.abs().sum() > 0 and model.mtp[0].self_attn.compressor is None


def test_mtp_incremental_equals_one_pass(model):
    ids = tokens(1, 61)  # the MTP runs over positions 0..59 (token 60 is the last "next token")
    full = mtp_logits(model, ids, [60])
    for sizes in ([1] * 60, [7, 13, 1, 20, 19], [16, 16, 28]):
        assert (mtp_logits(model, ids, sizes) - full).abs().max().item() < 1e-5
    assert full.shape == (60, model.cfg.vocab_size)


@torch.no_grad()
def test_mtp_batch_equals_each_alone(model):
    seqs = [tokens(s, n) for s, n in [(2, 30), (3, 9), (4, 45)]]
    alone = [mtp_logits(model, s, [len(s) - 1]) for s in seqs]
    states, streams = zip(*(main_streams(model, s) for s in seqs))
    batch = make_batch([s[1:] for s in seqs], [0, 0, 0], "cpu", logits_rows=[range(len(s) - 1) for s in seqs])
    prev = torch.cat([st[: len(s) - 1] for st, s in zip(streams, seqs)])
    together = model.mtp_forward(0, batch, list(states), prev).logits
    assert (together - torch.cat(alone)).abs().max().item() < 1e-5


@torch.no_grad()
def test_mtp_depends_on_both_inputs(model):
    ids = tokens(5, 20)
    state, streams = main_streams(model, ids)
    base = model.mtp_forward(0, make_batch([ids[1:]], [0], "cpu"), [state], streams[:19]).logits
    for nxt, prev in ((ids[1:18] + [7, 8], streams[:19]), (ids[1:], streams[:19] + 0.5 * torch.randn(streams[:19].shape, generator=torch.Generator().manual_seed(0)))):
        fresh, _ = main_streams(model, ids)
        other = model.mtp_forward(0, make_batch([nxt], [0], "cpu"), [fresh], prev).logits
        assert (other - base).abs().max().item() > 1e-3


def test_mtp_state_must_continue(model):
    state, streams = main_streams(model, tokens(6, 10))
    with pytest.raises(ValueError, match="MTP chunk starts at 4"):
        model.mtp_forward(0, make_batch([[5]], [4], "cpu"), [state], streams[4:5])
