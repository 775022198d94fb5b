"""Deliberate bugs in deepserve's V4.1 that the golden check must catch (the golden format's mutation list, applied
to deepserve's model instead of the reference): each one, run by the layer-forced protocol on the committed
golden directory, must fail some check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepserve.model.v41 import attention, load_v41, moe, numerics
from deepserve.model.v41 import model as v41_model
from deepserve.tools import golden_check

GOLDEN = Path(__file__).parent / "golden" / "v41" / "tiny_a"


def _high_ties(x, k):
    vals, idx = torch.sort(x.flip(-1), dim=-1, descending=True, stable=True)
    return vals[..., :k], x.shape[-1] - 1 - idx[..., :k]


def _set(m, **fields):
    for k, v in fields.items():
        object.__setattr__(m.cfg, k, v)


def _compress_theta(m, mp, theta):
    c = m.cfg
    for blk in m.layers:
        if blk.attn.ratio:
            blk.attn.inv_freq = numerics.rope_inv_freq(c.rope_head_dim, theta, c.original_seq_len, c.rope_factor,
                                                       c.beta_fast, c.beta_slow)


def _window_short(m, mp):
    orig = attention.window_columns

    def cols(win, start, seqlen, device):
        c = orig(win, start, seqlen, device)
        if start == 0:
            t = torch.arange(seqlen).unsqueeze(1)
            return torch.where(c <= t - (win - 1), -1, c)
        return torch.where(c == (start + 1) % win, -1, c) if start + 1 >= win else c

    mp.setattr(attention, "window_columns", cols)


def _own_index_keys(m, mp):
    """A kv source with an open group scores its own keys (the reference scores the keys published last)."""
    orig = attention.Attention._published_keys

    def keys(self, seq):
        return seq.layers[self.layer].index_keys if self.owns_index_keys else orig(self, seq)

    mp.setattr(attention.Attention, "_published_keys", keys)


MUTATIONS = {
    "no_engram": lambda m, mp: mp.setattr(v41_model.Engram, "forward", lambda self, x, ids: x),
    "unshifted_mhc": lambda m, mp: mp.setattr(
        v41_model.Block, "forward",
        lambda self, x, pre, attend, *rows, f=v41_model.Block.forward: f(self, x, self._mix(x, self.hc_attn, *rows)[0],
                                                                         attend, *rows)),
    "no_candidate_filter": lambda m, mp: mp.setattr(
        attention, "candidate_mask", lambda s, v, k, b: torch.ones_like(s, dtype=torch.bool)),
    "route_scale_1": lambda m, mp: _set(m, route_scale=1.0),
    "compress_theta_1e4": lambda m, mp: _compress_theta(m, mp, 1e4),
    "window_minus_1": _window_short,
    "index_topk_minus_1": lambda m, mp: _set(m, index_topk=m.cfg.index_topk - 1),
    "window_kv_not_fp8": lambda m, mp: mp.setattr(attention, "fp8_fake_quant", lambda x: x),
    "compressed_kv_not_fp4": lambda m, mp: mp.setattr(
        attention, "fp4_fake_quant", lambda x, g, e, f=attention.fp4_fake_quant: x if g == 16 else f(x, g, e)),
    "index_qk_not_fp4": lambda m, mp: mp.setattr(
        attention, "fp4_fake_quant", lambda x, g, e, f=attention.fp4_fake_quant: x if g == 32 else f(x, g, e)),
    "norm_eps_1e-6": lambda m, mp: _set(m, norm_eps=1e-6),
    "experts_minus_1": lambda m, mp: [setattr(b.ffn, "top_k", b.ffn.top_k - 1) for b in m.layers],
    "own_index_keys": _own_index_keys,
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_is_caught(name, monkeypatch):
    torch.set_num_threads(1)
    m = load_v41(GOLDEN / "tiny")
    MUTATIONS[name](m, monkeypatch)
    rep = golden_check.run(GOLDEN, "exact", model=m, prompts={1}, end_to_end=False)
    assert not rep.ok, f"{name} was not caught:\n{rep.table()}"


def test_the_references_own_tie_variant_stays_inside_the_envelope(monkeypatch):
    """Ties toward the higher index is one of the envelope's members, a numerically equivalent execution: the
    check must accept it (the calibration side of the mutations above)."""
    torch.set_num_threads(1)
    m = load_v41(GOLDEN / "tiny")
    monkeypatch.setattr(attention, "topk_low_ties", _high_ties)
    monkeypatch.setattr(moe, "topk_low_ties", _high_ties)
    rep = golden_check.run(GOLDEN, "all", model=m, prompts={1}, end_to_end=False)
    assert rep.ok, rep.table()
    assert any(r.value > 0 for r in rep.rows if r.check.startswith("forced"))  # the variant did change something
