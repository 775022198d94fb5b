"""The `Backend` ops a backend may fuse: their defaults are exactly the sequences of plain ops they stand for (so a
third-party backend that overrides none of them computes what the model did before they existed), and the
optional ones decline (None / False) so that the model's torch ops run. On the CPU reference backend, fp32."""

from __future__ import annotations

import math

import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.interfaces import VisibleRows
from deepserve.model.layouts.base import visible_rows

B = ReferenceBackend("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rope(d_rot: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, d_rot, 2).float() / d_rot))


def test_norm_and_rope_compositions():
    g = _gen(0)
    T, H, d = 3, 4, 32
    q, kv = torch.randn(T, H, d, generator=g), torch.randn(T, d, generator=g)
    w = 1 + 0.1 * torch.randn(d, generator=g)
    positions, inv_freq = torch.tensor([0, 7, 300]), _rope(16)
    got_q, got_k = B.qk_norm_rope(q, kv, w, 1e-6, positions, inv_freq)
    assert torch.equal(got_q, B.apply_rope(B.rms_norm(q, None, 1e-6), positions, inv_freq))
    assert torch.equal(got_k, B.apply_rope(B.rms_norm(kv, w, 1e-6), positions, inv_freq))
    x, weight = torch.randn(T, 64, generator=g), torch.randn(48, 64, generator=g)
    norm_w = 1 + 0.1 * torch.randn(64, generator=g)
    assert torch.equal(B.rms_norm_linear(x, norm_w, 1e-6, weight), B.linear(B.rms_norm(x, norm_w, 1e-6), weight))


def test_attention_with_inverse_rope():
    g = _gen(1)
    T, H, d, N = 3, 4, 32, 20
    q, kv = torch.randn(T, H, d, generator=g), torch.randn(N, d, generator=g)
    indices = torch.randint(-1, N, (T, 9), generator=g)
    sinks, positions, inv_freq = torch.randn(H, generator=g), torch.tensor([3, 9, 40]), _rope(16)
    got = B.sparse_attention_rope(q, kv, indices, sinks, d**-0.5, positions, inv_freq)
    want = B.apply_rope(B.sparse_attention(q, kv, indices, sinks, d**-0.5), positions, inv_freq, inverse=True)
    assert torch.equal(got, want)


def test_mhc_compositions():
    g = _gen(2)
    T, n, D = 2, 4, 16
    streams, y = torch.randn(T, n, D, generator=g), torch.randn(T, D, generator=g)
    fn = torch.randn((2 + n) * n, n * D, generator=g) / math.sqrt(n * D)
    base, scale = 0.5 * torch.randn((2 + n) * n, generator=g), torch.ones(3)
    w = 1 + 0.1 * torch.randn(D, generator=g)
    x, post, comb = B.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    got = B.hc_pre_norm(streams, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5)
    for a, b in zip(got, (B.rms_norm(x, w, 1e-5), post, comb)):
        assert torch.equal(a, b)
    head_fn, head_base, head_scale = fn[:n], base[:n], torch.ones(1)
    assert torch.equal(B.hc_head_norm(streams, head_fn, head_base, head_scale, 1e-6, 1e-6, w, 1e-5),
                       B.rms_norm(B.hc_head(streams, head_fn, head_base, head_scale, 1e-6, 1e-6), w, 1e-5))


def test_optional_decode_ops_decline():
    assert B.decoder_stack() is None  # the model runs its own layer loop
    storage, kv = torch.zeros(40, 8), torch.ones(2, 8)
    positions, slot, tables = torch.tensor([3, 5]), torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.long)
    assert B.decode_key_rows(storage, kv, positions, slot, tables, VisibleRows(4, 8), 4, 4, 8) is None
    assert not storage.any()  # declining wrote nothing


def test_visible_rows_rule():
    rule = VisibleRows(ratio=4, width=6)
    rows = visible_rows(torch.tensor([0, 3, 7, 30]), rule)
    assert rows.tolist() == [[-1] * 6, [0, -1, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5]]
