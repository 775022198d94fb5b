"""Each Triton kernel of the NVIDIA backend against the reference op, on fresh random inputs of V4-Flash shapes.

The oracle is the reference backend run on fp32 copies of the kernel's (bf16) inputs; the kernel must land
within bf16 rounding of it (relative L2 error under 1e-2) and write every output element (outputs are
NaN-poisoned first). The `check_*` functions take the device and shapes, so the same checks run on the CPU under
Triton's interpreter (TRITON_INTERPRET=1) with small shapes: tests/test_kernels_interpreted.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepserve.backends.reference import ReferenceBackend

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

BF16_TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output holds NaN (an element was not written)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, g, device, dtype=torch.bfloat16, std=1.0):
    return (torch.randn(shape, generator=g, device=device) * std).to(dtype)


# -- checks ---------------------------------------------------------------------------------------------------------
def check_sparse_attention(device, T, H, d, N, window, topk, seed=0, dtype=torch.bfloat16, rope_dim=0) -> float:
    """`sparse_mqa` against the reference's attention; `rope_dim` > 0: with the inverse RoPE of that many dims
    fused (`sparse_attention_rope`), against the reference's attention then inverse RoPE."""
    from deepserve.backends.nvidia.triton_ops.attention import sparse_mqa

    g = gen(device, seed)
    q, kv = randn((T, H, d), g, device, dtype), randn((N, d), g, device, dtype)
    K = window + topk
    indices = torch.randint(0, N, (T, K), generator=g, device=device)
    # ragged lists: each query drops a random tail and a few random entries, like early positions and unused top-k
    keep = torch.randint(1, K + 1, (T, 1), generator=g, device=device)
    holes = torch.rand((T, K), generator=g, device=device) < 0.1
    indices = torch.where((torch.arange(K, device=device)[None, :] < keep) & ~holes, indices, -1)
    if T > 1:
        indices[0] = -1  # a query that sees nothing but its sink: its output is zero
    sinks = torch.randn(H, generator=g, device=device)
    scale = d**-0.5
    ref_b = ReferenceBackend(device)
    ref = ref_b.sparse_attention(q.float(), kv.float(), indices, sinks, scale)
    rope = None
    if rope_dim:
        positions = torch.randint(0, 5000, (T,), generator=g, device=device)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
        rope = (positions, inv_freq)
        ref = ref_b.apply_rope(ref, positions, inv_freq, inverse=True)
    out = sparse_mqa(q, kv, indices, sinks, scale, out=poisoned(q.shape, dtype, device), rope=rope)
    if T > 1:
        assert not out[0].any(), "a query with no keys must output zeros"
    return rel_err(out, ref)


def check_indexer(device, T, Hi, Di, rows_per_seq, topk, seed=0, rpp=0) -> tuple[float, float]:
    """Returns (relative error of the scores, fraction of the reference's top-k the kernel also chose). `rpp` > 0:
    the same keys in shuffled pages of `rpp` rows read through block tables (`indexer_topk_paged`), else flat."""
    from deepserve.backends.nvidia.triton_ops.indexer import indexer_scores, indexer_topk, indexer_topk_paged

    g = gen(device, seed)
    q = randn((T, Hi, Di), g, device)
    weights = torch.randn((T, Hi), generator=g, device=device) * Hi**-0.5
    keys = randn((T * rows_per_seq, Di), g, device)
    key_start = torch.arange(T, device=device) * rows_per_seq
    key_count = torch.randint(0, rows_per_seq + 1, (T,), generator=g, device=device)
    key_count[0] = rows_per_seq
    width = int(key_count.max())
    tables = pages = None
    if rpp:  # query t's key r: page tables[t, r // rpp], row r % rpp
        order = torch.randperm(T * rows_per_seq // rpp, generator=g, device=device)
        pages = torch.empty((order.numel(), rpp, Di), dtype=keys.dtype, device=device)
        pages[order] = keys.view(-1, rpp, Di)
        tables = order.view(T, -1)
    scores = indexer_scores(q, weights, pages if rpp else keys, key_start, key_count, width,
                            out=poisoned((T, width), torch.float32, device), tables=tables)
    offs = torch.arange(width, device=device)
    visible = offs[None, :] < key_count[:, None]
    k = keys[(key_start[:, None] + offs[None, :]).clamp(max=keys.shape[0] - 1)].double()
    ref_scores = (torch.relu(torch.einsum("thd,twd->thw", q.double(), k)) * weights.double()[:, :, None]).sum(1)
    ref_scores = ref_scores.masked_fill(~visible, float("-inf"))
    assert torch.equal(torch.isinf(scores), ~visible)
    err = rel_err(scores[visible], ref_scores[visible])
    if rpp:  # key numbers within each query's own keys: made rows of the flat keys
        chosen = indexer_topk_paged(q, weights, pages, tables, key_count, topk)
        chosen = torch.where(chosen >= 0, key_start[:, None] + chosen, -1)
    else:
        chosen = indexer_topk(q, weights, keys, key_start, key_count, topk)
    expect = ReferenceBackend(device).indexer_topk(q.float(), weights, keys.float(), key_start, key_count, topk)
    valid = chosen >= 0
    assert torch.equal(valid, expect >= 0), "a different number of keys chosen"
    in_range = (chosen >= key_start[:, None]) & (chosen < (key_start + key_count)[:, None])
    assert bool((in_range | ~valid).all()), "a chosen row outside its query's keys"
    ascending = (torch.where(valid, chosen, torch.iinfo(torch.long).max).diff(dim=1) > 0) | ~valid[:, 1:]
    assert bool(ascending.all()), "chosen rows not in ascending order, unused slots last"
    overlap = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(chosen, expect))
    return err, overlap / max(int(valid.sum()), 1)


def check_moe(device, T, D, I, E, top_k, seed=0) -> float:
    from deepserve.backends.nvidia.triton_ops.moe import moe_experts

    g = gen(device, seed)
    x = randn((T, D), g, device)
    w13 = randn((E, 2 * I, D), g, device, std=D**-0.5)
    w2 = randn((E, D, I), g, device, std=I**-0.5)
    scores = torch.rand((T, E), generator=g, device=device)
    weights, ids = torch.topk(scores, top_k, dim=1)
    limit = 1.5  # small enough that the clamp bites on a good share of the gate and up values
    pair_out = poisoned((T * top_k, D), torch.bfloat16, device)
    out = moe_experts(x, ids, weights, w13, w2, limit, pair_out=pair_out)
    assert not torch.isnan(pair_out).any(), "a (token, expert) pair was not written"
    ref = ReferenceBackend(device).moe_experts(x.float(), ids, weights, w13.float(), w2.float(), limit)
    return rel_err(out, ref)


def check_moe_small(device, T, D, I, E, top_k, seed=0, dtype=torch.bfloat16) -> float:
    """`moe_small` (routed + shared expert) against the reference's routed experts plus its shared expert."""
    from deepserve.backends.nvidia.triton_ops.moe import moe_small

    g = gen(device, seed)
    x = randn((T, D), g, device, dtype)
    w13 = randn((E, 2 * I, D), g, device, dtype, std=D**-0.5)
    w2 = randn((E, D, I), g, device, dtype, std=I**-0.5)
    s13, s2 = randn((2 * I, D), g, device, dtype, std=D**-0.5), randn((D, I), g, device, dtype, std=I**-0.5)
    weights, ids = torch.topk(torch.rand((T, E), generator=g, device=device), top_k, dim=1)
    if top_k > 1:
        ids[0, 1] = ids[0, 0]  # a token picking an expert twice counts it twice
    limit = 1.5
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    for _ in range(2):  # twice on the same counters: a call leaves them at zero
        out = moe_small(x, ids, weights * 1.5, w13, w2, limit, s13, s2, counters)
        assert not counters.any()
    ref_b = ReferenceBackend(device)
    xf = x.float()
    ref = ref_b.moe_experts(xf, ids, weights * 1.5, w13.float(), w2.float(), limit)
    gate, up = ref_b.linear(xf, s13.float()).chunk(2, dim=-1)
    ref = ref + ref_b.linear(ref_b.swiglu(gate, up, limit), s2.float())
    return rel_err(out, ref)


class TorchGroupedGemm:
    """DeepGEMM's `m_grouped_bf16_gemm_nt_contiguous` contract done with torch (row r of d is a[r] @ b[e].T for
    its expert e = layout[r], rows with e = -1 left alone): checks the layout deepserve builds for it."""

    def __init__(self, alignment: int):
        self.alignment = alignment

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return self.alignment

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, layout):
        assert a.shape[0] == d.shape[0] == layout.shape[0] and layout.dtype == torch.int32
        assert a.shape[0] % self.alignment == 0
        for e in range(b.shape[0]):
            rows = (layout == e).nonzero().flatten()
            if rows.numel():
                assert rows.numel() % self.alignment == 0 or (layout[rows[-1] + 1:] != e).all()
                d[rows] = (a[rows].float() @ b[e].float().t()).to(d.dtype)


def check_moe_deep_gemm(device, T, D, I, E, top_k, dg=None, seed=0, dtype=torch.bfloat16) -> float:
    """`vendor.moe_experts_deep_gemm` (DeepGEMM's grouped GEMMs when `dg` is the module, else their torch
    stand-in) against the reference's routed experts."""
    from deepserve.backends.nvidia.vendor import moe_experts_deep_gemm

    g = gen(device, seed)
    x = randn((T, D), g, device, dtype)
    w13 = randn((E, 2 * I, D), g, device, dtype, std=D**-0.5)
    w2 = randn((E, D, I), g, device, dtype, std=I**-0.5)
    weights, ids = torch.topk(torch.rand((T, E), generator=g, device=device), top_k, dim=1)
    ids[:, 0] = 0  # one expert with many rows, others with few or none
    out = moe_experts_deep_gemm(dg or TorchGroupedGemm(16), x, ids, weights, w13, w2, 1.5)
    ref = ReferenceBackend(device).moe_experts(x.float(), ids, weights, w13.float(), w2.float(), 1.5)
    return rel_err(out, ref)


def check_hc(device, T, n, D, iters=20, seed=0) -> tuple[float, float, float, float]:
    """Relative errors of hc_pre's (collapsed, post, comb) and of hc_post."""
    from deepserve.backends.nvidia.triton_ops.mhc import hc_post, hc_pre

    g = gen(device, seed)
    streams = randn((T, n, D), g, device)
    fn = torch.randn(((2 + n) * n, n * D), generator=g, device=device) * 0.5 / math.sqrt(n * D)
    base = 0.5 * torch.randn((2 + n) * n, generator=g, device=device)
    scale = 1.0 + 0.2 * torch.randn(3, generator=g, device=device)
    ref_b = ReferenceBackend(device)
    x, post, comb = hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6, out=poisoned((T, D), torch.bfloat16, device))
    rx, rpost, rcomb = ref_b.hc_pre(streams.float(), fn, base, scale, iters, 1e-6, 1e-6)
    y = randn((T, D), g, device)
    new = hc_post(streams, y, post, comb, out=poisoned(streams.shape, torch.bfloat16, device))
    rnew = ref_b.hc_post(streams.float(), y.float(), rpost, rcomb)
    return rel_err(x, rx), rel_err(post, rpost), rel_err(comb, rcomb), rel_err(new, rnew)


def check_hc_head(device, T, n, D, dtype=torch.bfloat16, seed=0) -> float:
    """Relative error of the Triton `hc_head` (the final collapse) against the reference's, in `dtype`."""
    from deepserve.backends.nvidia.triton_ops.mhc import hc_head

    g = gen(device, seed)
    streams = randn((T, n, D), g, device, dtype=dtype)
    fn = torch.randn((n, n * D), generator=g, device=device) * 0.5 / math.sqrt(n * D)
    base = 0.5 * torch.randn(n, generator=g, device=device)
    scale = 1.0 + 0.2 * torch.randn(1, generator=g, device=device)
    out = hc_head(streams, fn, base, scale, 1e-6, 1e-6, out=poisoned((T, D), dtype, device))
    ref = ReferenceBackend(device).hc_head(streams.float(), fn, base, scale, 1e-6, 1e-6)
    assert out.dtype == dtype and out.shape == (T, D)
    return rel_err(out, ref)


def check_hc_pre_norm(device, T, n, D, dtype=torch.bfloat16, seed=0) -> float:
    """`hc_pre` with the block's input norm fused (`hc_pre_norm`) against the reference's hc_pre then rms_norm:
    the worst relative error of (normed, post, comb)."""
    from deepserve.backends.nvidia.triton_ops.mhc import hc_pre

    g = gen(device, seed)
    streams = randn((T, n, D), g, device, dtype=dtype)
    fn = torch.randn(((2 + n) * n, n * D), generator=g, device=device) * 0.5 / math.sqrt(n * D)
    base = 0.5 * torch.randn((2 + n) * n, generator=g, device=device)
    scale = 1.0 + 0.2 * torch.randn(3, generator=g, device=device)
    weight = 1.0 + 0.1 * torch.randn(D, generator=g, device=device)
    got = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, out=poisoned((T, D), dtype, device), norm=(weight, 1e-5))
    want = ReferenceBackend(device).hc_pre_norm(streams.float(), fn, base, scale, 20, 1e-6, 1e-6, weight, 1e-5)
    assert got[0].dtype == dtype
    return max(rel_err(a, b) for a, b in zip(got, want))


def check_hc_post_mix(device, T, n, D, seed=0) -> tuple[float, float]:
    """`hc_post_mix` then `hc_pre` from its partial sums, against `hc_post` then `hc_pre` on its own (bf16
    streams): (relative error of the new streams, worst of hc_pre's three outputs)."""
    from deepserve.backends.nvidia.triton_ops.mhc import hc_post, hc_post_mix, hc_pre

    g = gen(device, seed)
    streams = randn((T, n, D), g, device)
    y = randn((T, D), g, device)
    post = torch.rand((T, n), generator=g, device=device) * 2
    comb = torch.softmax(torch.randn((T, n, n), generator=g, device=device), dim=-1)
    fn = torch.randn(((2 + n) * n, n * D), generator=g, device=device) * 0.5 / math.sqrt(n * D)
    base = 0.5 * torch.randn((2 + n) * n, generator=g, device=device)
    scale = 1.0 + 0.2 * torch.randn(3, generator=g, device=device)
    new, mix = hc_post_mix(streams, y, post, comb, fn)
    assert mix is not None and new.dtype == streams.dtype
    want = hc_post(streams, y, post, comb)
    got = hc_pre(new, fn, base, scale, 20, 1e-6, 1e-6, mix=mix)
    ref = hc_pre(new, fn, base, scale, 20, 1e-6, 1e-6)
    return rel_err(new, want), max(rel_err(a, b) for a, b in zip(got, ref))


def check_window_write(device, T, W, D, slots, seed=0) -> None:
    """`paged_window_write` against the torch scatter it replaces, with strided position and slot columns."""
    from deepserve.backends.nvidia.triton_ops.decode import paged_window_write

    g = gen(device, seed)
    storage = randn((slots * W + 7, D), g, device)
    kv = randn((T, D), g, device)
    slot = torch.randperm(slots, generator=g, device=device)[:T]
    positions = torch.randint(0, 10 * W, (T,), generator=g, device=device)
    meta = torch.stack((positions, slot), dim=1)  # columns of one tensor, as a static step passes them
    expect = storage.clone()
    expect[slot * W + positions % W] = kv
    paged_window_write(storage, kv, meta[:, 0], meta[:, 1], W)
    assert torch.equal(storage, expect)


def check_rms_norm(device, shape, weighted, dtype=torch.bfloat16, seed=0) -> float:
    from deepserve.backends.nvidia.triton_ops.elementwise import rms_norm

    g = gen(device, seed)
    x = randn(shape, g, device, dtype, std=3.0)
    w = 1.0 + 0.1 * torch.randn(shape[-1], generator=g, device=device) if weighted else None
    out = rms_norm(x, w, 1e-6, out=poisoned(shape, dtype, device))
    return rel_err(out, ReferenceBackend(device).rms_norm(x.float(), w, 1e-6))


def check_rope(device, T, H, d, rope_dim, max_pos, inverse, seed=0, tiles=None) -> float:
    from deepserve.backends.nvidia.triton_ops.elementwise import apply_rope

    g = gen(device, seed)
    x = randn((T, H, d), g, device)
    positions = torch.randint(0, max_pos, (T,), generator=g, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    out = apply_rope(x, positions, inv_freq, inverse, out=poisoned(x.shape, torch.bfloat16, device), tiles=tiles)
    ref = ReferenceBackend(device).apply_rope(x.float(), positions, inv_freq, inverse)
    assert torch.equal(out[..., : d - rope_dim], x[..., : d - rope_dim]), "the unrotated dims changed"
    return rel_err(out, ref)


def check_norm_rope(device, shape, rope_dim, weighted, seed=0, dtype=torch.bfloat16) -> float:
    """`rms_norm_rope` against the reference's rms_norm then apply_rope, on a strided view of its input (the
    key projection is a column slice of the grouped input projections)."""
    from deepserve.backends.nvidia.triton_ops.elementwise import rms_norm_rope

    g = gen(device, seed)
    T, d = shape[0], shape[-1]
    wide = randn((T, *shape[1:-1], d + 8), g, device, dtype)
    x = wide[..., 4 : 4 + d]
    weight = 1.0 + 0.1 * torch.randn(d, generator=g, device=device) if weighted else None
    positions = torch.randint(0, 5000, (T,), generator=g, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    out = rms_norm_rope(x, weight, 1e-6, positions, inv_freq)
    ref_b = ReferenceBackend(device)
    ref = ref_b.apply_rope(ref_b.rms_norm(x.float(), weight, 1e-6), positions, inv_freq)
    assert out.shape == x.shape
    return rel_err(out, ref)


def check_qk_norm_rope(device, T, H, d, rope_dim, seed=0, dtype=torch.bfloat16) -> float:
    """`qk_norm_rope` against the reference's rms_norm then apply_rope of each, on strided views of its inputs
    (the query projection's rows, a column slice of the grouped input projections for the key)."""
    from deepserve.backends.nvidia.triton_ops.elementwise import qk_norm_rope

    g = gen(device, seed)
    q = randn((T, H, d + 8), g, device, dtype)[..., 4 : 4 + d]
    kv = randn((T, d + 40), g, device, dtype)[:, 16 : 16 + d]
    weight = 1.0 + 0.1 * torch.randn(d, generator=g, device=device)
    positions = torch.randint(0, 5000, (T,), generator=g, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    got_q, got_k = qk_norm_rope(q, kv, weight, 1e-6, positions, inv_freq)
    ref_b = ReferenceBackend(device)
    want_q = ref_b.apply_rope(ref_b.rms_norm(q.float(), None, 1e-6), positions, inv_freq)
    want_k = ref_b.apply_rope(ref_b.rms_norm(kv.float(), weight, 1e-6), positions, inv_freq)
    assert got_q.shape == q.shape and got_k.shape == kv.shape
    return max(rel_err(got_q, want_q), rel_err(got_k, want_k))


def check_compress_decode(device, B, ratio, D, overlap, rope_dim=64, steps=3, seed=0, dtype=torch.float32) -> float:
    """The fused `compress_decode` kernel against the model's torch ops (`layouts.static.emit_static` on the reference
    backend) over `steps` decode steps of B sequences at random positions (blocks closing and not, block 0 and
    later): every frontier, overlap and row tensor, relative error, NaN-poisoned rows that only the closing
    writes may fill."""
    from types import SimpleNamespace

    from deepserve.backends.nvidia.triton_ops.decode import compress_decode
    from deepserve.core.config import ModelConfig
    from deepserve.model.compressor import _Pooler
    from deepserve.model.kv_precision import PlainRows
    from deepserve.model.layouts.static import emit_static
    from deepserve.tools.demo_checkpoint import DEMO_CONFIG

    g = gen(device, seed)
    cfg = ModelConfig.from_dict({**DEMO_CONFIG, "vocab_size": 300, "hidden_size": 64})
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    pooler = _Pooler(cfg, ReferenceBackend(device), ratio, D, overlap, inv_freq).to(device)
    with torch.no_grad():
        for t in pooler.parameters():
            t.copy_(torch.randn(t.shape, generator=g, device=device) * 0.5)
    F = 2 * D if overlap else D
    slots, pages, rpp, P = B + 1, 4 * B + 1, 64 // ratio if ratio < 64 else 2, 3
    f32 = dict(dtype=torch.float32, device=device)
    state = dict(open_kv=torch.randn((slots, ratio, F), generator=g, **f32),
                 open_gate=torch.randn((slots, ratio, F), generator=g, **f32),
                 prev_kv=torch.randn((slots, ratio, D), generator=g, **f32) if overlap else None,
                 prev_gate=torch.randn((slots, ratio, D), generator=g, **f32) if overlap else None,
                 rows=torch.full((pages, rpp, D), float("nan"), dtype=dtype, device=device))
    mine = {k: v.clone() if v is not None else None for k, v in state.items()}
    tables = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(seed))[: B * P].view(B, P).to(device)
    slot = torch.randperm(B, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    positions = torch.randint(0, P * rpp * ratio - steps, (B,), generator=g, device=device)
    positions[0] = ratio - 1  # block 0 closes: no previous block
    for _ in range(steps):
        x = torch.randn((B, 64), generator=g, device=device)
        index = SimpleNamespace(slot=slot[:, None], tables=tables)
        pools = SimpleNamespace(**state, codec=PlainRows(D, dtype, dtype))  # rows kept as they are
        kv, gate = pooler.kv_proj(x), pooler.gate_proj(x)
        emit_static(pooler, kv, gate, positions, index, pools, pad_slot=B, trash_page=pages - 1)
        compress_decode(kv, gate, pooler.position_bias, positions, slot, tables, mine["open_kv"], mine["open_gate"],
                        mine["prev_kv"], mine["prev_gate"], mine["rows"], pooler.kv_norm.weight, inv_freq, pooler.eps)
        positions = positions + 1
    worst = 0.0
    for k in state:
        if state[k] is None:
            continue
        a, b = mine[k][:B].float(), state[k][:B].float()  # the padding slot / trash page: the reference's alone
        if k == "rows":
            a, b = mine[k][: pages - 1].float(), state[k][: pages - 1].float()
            assert torch.equal(torch.isnan(a), torch.isnan(b)), "rows written differ"
            a, b = a.nan_to_num(), b.nan_to_num()
        worst = max(worst, rel_err(a, b) if b.norm() > 0 else float((a - b).abs().max()))
    return worst


def check_compress_decode_packed(device, B, ratio, D, overlap, kind, rope_dim=64, steps=3, seed=0,
                                 turn="hadamard") -> float:
    """The fused `compress_decode` storing packed rows (`store` "fp8": `FP8Rows`; "fp4": `FP4Keys`, turned by
    `turn` first) against itself storing fp32 values, from the same state over `steps` decode steps: the frontier
    and overlap tensors equal, every closing row's bytes where the values run wrote a row and no other page's
    bytes touched. FP8 and FP4 under the identity turn: the bytes are the codec's `encode` of the values run's
    row, bit for bit (returns 0). FP4 under the Hadamard matrix (the kernel's sum against torch's matmul): returns
    the share of nibbles that differ from encoding the torch-turned rows."""
    from deepserve.backends.nvidia.triton_ops.decode import compress_decode
    from deepserve.model.kv_precision import KVPrecision, hadamard_matrix

    g = gen(device, seed)
    F = 2 * D if overlap else D
    slots, pages, rpp, P = B + 1, 4 * B + 1, 64 // ratio if ratio < 64 else 2, 3
    precision = KVPrecision("fp8", rope_dim if kind == "fp8" else 0)
    codec = precision.kv_codec(D, torch.float32) if kind == "fp8" else precision.index_key_codec(D, torch.float32)
    matrix = None
    if kind == "fp4":
        matrix = hadamard_matrix(D, device) if turn == "hadamard" else torch.eye(D, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    state = dict(open_kv=torch.randn((slots, ratio, F), generator=g, **f32),
                 open_gate=torch.randn((slots, ratio, F), generator=g, **f32),
                 prev_kv=torch.randn((slots, ratio, D), generator=g, **f32) if overlap else None,
                 prev_gate=torch.randn((slots, ratio, D), generator=g, **f32) if overlap else None)
    values = {k: v.clone() if v is not None else None for k, v in state.items()}
    rows = torch.full((pages, rpp, D), float("nan"), **f32)
    garbage = torch.randint(0, 256, (pages, rpp, codec.stored_width), generator=g, device=device, dtype=torch.uint8)
    packed = garbage.clone()
    tables = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(seed))[: B * P].view(B, P).to(device)
    slot = torch.randperm(B, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    positions = torch.randint(0, P * rpp * ratio - steps, (B,), generator=g, device=device)
    positions[0] = ratio - 1
    bias = torch.randn((ratio, F), generator=g, **f32)
    norm = 1.0 + 0.1 * torch.randn(D, generator=g, **f32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    for _ in range(steps):
        kv, gate = torch.randn((B, F), generator=g, **f32), torch.randn((B, F), generator=g, **f32)
        args = (kv, gate, bias, positions, slot, tables)
        compress_decode(*args, values["open_kv"], values["open_gate"], values["prev_kv"], values["prev_gate"], rows,
                        norm, inv_freq, 1e-6)
        compress_decode(*args, state["open_kv"], state["open_gate"], state["prev_kv"], state["prev_gate"], packed,
                        norm, inv_freq, 1e-6, store=kind, turn=matrix)
        positions = positions + 1
    for k in state:
        if state[k] is not None:
            assert torch.equal(state[k], values[k]), f"{k} differs between the packed and the values run"
    written = ~torch.isnan(rows).any(dim=-1)  # [pages, rpp]
    assert written.any() and torch.equal(packed[~written], garbage[~written]), "a row not closed was written"
    got, closed = packed[written].cpu(), rows[written]
    if kind == "fp8":
        assert torch.equal(got, codec.encode(closed).cpu()), "FP8 rows differ from the codec's bytes"
        return 0.0
    want = codec.encode(closed @ matrix).cpu()
    if turn != "hadamard":
        assert torch.equal(got, want), "FP4 keys differ from the codec's bytes"
        return 0.0
    half = -(-D // 2)
    nibbles = lambda b: torch.stack([b[:, :half] & 15, b[:, :half] >> 4], -1)  # noqa: E731
    return (nibbles(got) != nibbles(want)).float().mean().item()


def check_paged_key_rows(device, T, W, K, rpp, seed=0) -> None:
    """The `paged_key_rows` kernel equals the torch index arithmetic of `layouts.paged.paged_keys`, exactly."""
    from deepserve.backends.nvidia.triton_ops.decode import paged_key_rows

    g = gen(device, seed)
    positions = torch.randint(0, 5000, (T,), generator=g, device=device)
    positions[:2] = torch.tensor([0, W - 3])
    start = (positions - torch.randint(0, 3, (T,), generator=g, device=device)).clamp(min=0)[:, None]
    offset = torch.randint(0, 50, (T,), generator=g, device=device)[:, None]
    slot = torch.randint(0, 30, (T,), generator=g, device=device)[:, None]
    tables = torch.randint(0, 100, (T, 8), generator=g, device=device)
    compressed = torch.randint(-1, 8 * rpp, (T, K), generator=g, device=device) if K else None
    got = paged_key_rows(positions, start, offset, slot, tables, compressed, W, rpp, 1000, 9000)
    key_pos = positions[:, None] - (W - 1) + torch.arange(W, device=device)[None, :]
    window = torch.where(key_pos < start, slot * W + key_pos % W, 9000 + offset + key_pos - start)
    expect = torch.where(key_pos >= 0, window, -1)
    if K:
        row = compressed.clamp(min=0)
        page = torch.gather(tables, 1, row // rpp)
        expect = torch.cat((expect, torch.where(compressed >= 0, 1000 + page * rpp + row % rpp, -1)), dim=1)
    assert torch.equal(got, expect)


def check_decode_key_rows(device, T, W, K, rpp, ratio=0, D=64, seed=0) -> None:
    """`decode_key_rows` against what it replaces, exactly: the ring write (torch's scatter) and the key rows of
    `paged_key_rows` with every window key in the ring (a chunk start past the position). `ratio` > 0: the
    compressed rows as the rule `VisibleRows(ratio, K)`, against its explicit list."""
    from deepserve.backends.nvidia.triton_ops.decode import decode_key_rows, paged_key_rows
    from deepserve.core.interfaces import VisibleRows
    from deepserve.model.layouts.base import visible_rows

    g = gen(device, seed)
    slots = T + 3
    positions = torch.randint(0, 5000, (T,), generator=g, device=device)
    positions[: min(T, 2)] = torch.tensor([0, W - 3][: min(T, 2)])
    slot = torch.randperm(slots, generator=g, device=device)[:T]
    meta = torch.stack((positions, slot), dim=1)  # columns of one tensor, as a static step passes them
    tables = torch.randint(0, 100, (T, 8), generator=g, device=device)
    storage = randn((slots * W + 5, D), g, device)
    kv = randn((T, D), g, device)
    if ratio:
        rule = VisibleRows(ratio, K)
        compressed, explicit = rule, visible_rows(positions, rule)
    else:
        compressed = explicit = torch.randint(-1, 8 * rpp, (T, K), generator=g, device=device) if K else None
    expect_storage = storage.clone()
    expect_storage[slot * W + positions % W] = kv
    expect = paged_key_rows(positions, (positions + 1)[:, None], slot[:, None] * 0, slot[:, None], tables, explicit,
                            W, rpp, 1000, 9000)
    got = decode_key_rows(storage, kv, meta[:, 0], meta[:, 1], tables, compressed, W, rpp, 1000)
    assert torch.equal(storage, expect_storage)
    assert torch.equal(got, expect)


# -- the tests, at V4-Flash shapes ------------------------------------------------------------------------------------
CUDA = "cuda"


@pytest.mark.parametrize("T", [1, 4, 64])  # 1-4: the rotation in the merge; 64: in the attention kernel
def test_sparse_attention_rope(T):
    err = check_sparse_attention(CUDA, T, 64, 512, N=8192, window=128, topk=512, seed=T, rope_dim=64)
    print(f"sparse attention + inverse RoPE T={T}: {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("T", [1, 5, 16, 64, 2048])  # 1-16: the index list split into parts, then merged
def test_sparse_attention(T):
    # 64 heads of 512 over one K=V head; window 128 + top-512 compressed rows
    err = check_sparse_attention(CUDA, T, 64, 512, N=8192, window=128, topk=512, seed=T)
    print(f"sparse_attention T={T}: rel err {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("rpp", [0, 64])  # flat keys; paged (as a decode step reads them)
@pytest.mark.parametrize("T", [1, 64, 256])  # the reference materialises [T, 64, 2048, 128] fp32
def test_indexer(T, rpp):
    err, overlap = check_indexer(CUDA, T, 64, 128, rows_per_seq=2048, topk=512, seed=T, rpp=rpp)
    print(f"indexer T={T}: scores rel err {err:.2e}, top-k overlap {overlap:.4f}")
    assert err < 1e-3  # bf16 products summed in fp32
    assert overlap > 0.98  # only near-ties at the cut may differ


@pytest.mark.parametrize("T", [1, 64, 1000, 3000])  # 3000 x 6 pairs: prefill's 128-row blocks
def test_moe_experts(T):
    err = check_moe(CUDA, T, D=4096, I=2048, E=32, top_k=6, seed=T)
    print(f"moe_experts T={T}: rel err {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("shape,weighted", [((1, 64, 512), False), ((300, 64, 512), False), ((3, 512), True),
                                            ((2, 64, 128), True)])
def test_rms_norm_rope(shape, weighted):
    assert check_norm_rope(CUDA, shape, 64, weighted, seed=shape[0]) < BF16_TOL


@pytest.mark.parametrize("T", [1, 4, 300])
def test_qk_norm_rope(T):
    assert check_qk_norm_rope(CUDA, T, 64, 512, 64, seed=T) < BF16_TOL


@pytest.mark.parametrize("T", [1, 64])
def test_paged_window_write(T):
    check_window_write(CUDA, T, W=128, D=512, slots=100, seed=T)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_moe_small(T):
    err = check_moe_small(CUDA, T, D=4096, I=2048, E=32, top_k=6, seed=T)
    print(f"moe_small T={T}: rel err {err:.2e}")
    assert err < BF16_TOL


def test_moe_sorted_layout_and_combine():
    """The layout, gathers and weighted sum around the vendor grouped GEMM, with a torch stand-in for it."""
    assert check_moe_deep_gemm(CUDA, 300, D=256, I=128, E=8, top_k=3) < BF16_TOL


@pytest.mark.parametrize("T", [700, 4096])
def test_moe_deep_gemm(T):
    """DeepGEMM's grouped GEMMs in the routed experts, where it is installed and loads."""
    from deepserve.backends.nvidia import NvidiaBackend

    dg = NvidiaBackend().deep_gemm
    if dg is None:
        pytest.skip("deep_gemm is not installed or does not load here")
    err = check_moe_deep_gemm(CUDA, T, D=4096, I=2048, E=32, top_k=6, dg=dg, seed=T)
    print(f"moe_experts_deep_gemm T={T}: rel err {err:.2e}")
    assert err < BF16_TOL


def test_backend_fuses_the_shared_expert_for_few_tokens():
    """The model's MoE through `moe_with_shared` (one token) equals its routed + shared path within bf16, and
    wider steps or fp32 weights are declined."""
    from deepserve.backends.nvidia import NvidiaBackend

    b = NvidiaBackend()
    g = gen(CUDA, 7)
    w13, w2 = randn((8, 256, 512), g, CUDA, std=512**-0.5), randn((8, 512, 128), g, CUDA, std=128**-0.5)
    s13, s2 = randn((256, 512), g, CUDA, std=512**-0.5), randn((512, 128), g, CUDA, std=128**-0.5)
    for T in (1, 2):
        x = randn((T, 512), g, CUDA)
        weights, ids = torch.topk(torch.rand((T, 8), generator=g, device=CUDA), 2, dim=1)
        out = b.moe_with_shared(x, ids, weights, w13, w2, 10.0, s13, s2)
        if T > 1:
            assert out is None
            continue
        gate, up = b.linear(x, s13).chunk(2, dim=-1)
        ref = b.moe_experts(x, ids, weights, w13, w2, 10.0) + b.linear(b.swiglu(gate, up, 10.0), s2)
        assert rel_err(out, ref) < BF16_TOL
    x = randn((1, 512), g, CUDA)
    assert b.moe_with_shared(x.float(), ids[:1], weights[:1], w13.float(), w2.float(), 10.0, s13.float(),
                             s2.float()) is None


@pytest.mark.parametrize("T", [1, 64, 300, 4100])  # above 64 tokens: the mix from three bf16 terms of fn
def test_hc(T):
    x, post, comb, new = check_hc(CUDA, T, n=4, D=4096, seed=T)
    print(f"hc T={T}: collapsed {x:.2e}, post {post:.2e}, comb {comb:.2e}, hc_post {new:.2e}")
    assert x < BF16_TOL and new < BF16_TOL
    assert post < 1e-5 and comb < 1e-5  # fp32 throughout


@pytest.mark.parametrize("T", [1, 4, 64])
def test_hc_post_mix(T):
    streams_err, pre_err = check_hc_post_mix(CUDA, T, n=4, D=4096, seed=T)
    print(f"hc_post_mix T={T}: streams {streams_err:.2e}, hc_pre from its parts {pre_err:.2e}")
    assert streams_err < BF16_TOL and pre_err < 1e-3  # the same bf16 streams: only the sums' order differs


def check_hc_head_norm_from_post_mix(device, T, n, D, seed=0) -> float:
    """The final head with its norm fused (`hc_head_norm`), from the mix that the last `hc_post_mix` left,
    against the reference's hc_head then rms_norm."""
    from deepserve.backends.nvidia.triton_ops.mhc import hc_head, hc_post_mix

    g = gen(device, seed)
    streams, y = randn((T, n, D), g, device), randn((T, D), g, device)
    post = torch.rand((T, n), generator=g, device=device) * 2
    comb = torch.softmax(torch.randn((T, n, n), generator=g, device=device), dim=-1)
    fn = torch.randn((n, n * D), generator=g, device=device) * 0.5 / math.sqrt(n * D)
    base = 0.5 * torch.randn(n, generator=g, device=device)
    scale = 1.0 + 0.2 * torch.randn(1, generator=g, device=device)
    weight = 1.0 + 0.1 * torch.randn(D, generator=g, device=device)
    new, mix = hc_post_mix(streams, y, post, comb, fn)
    assert mix is not None
    got = hc_head(new, fn, base, scale, 1e-6, 1e-6, out=poisoned((T, D), torch.bfloat16, device),
                  norm=(weight, 1e-5), mix=mix)
    want = ReferenceBackend(device).hc_head_norm(new.float(), fn, base, scale, 1e-6, 1e-6, weight, 1e-5)
    return rel_err(got, want)


@pytest.mark.parametrize("T", [1, 4])
def test_hc_head_norm_from_post_mix(T):
    assert check_hc_head_norm_from_post_mix(CUDA, T, n=4, D=4096, seed=T) < BF16_TOL


@pytest.mark.parametrize("T", [1, 4, 300])
def test_hc_pre_norm(T):
    err = check_hc_pre_norm(CUDA, T, n=4, D=4096, seed=T)
    print(f"hc_pre_norm T={T}: {err:.2e}")
    assert err < BF16_TOL
    assert check_hc_pre_norm(CUDA, T, n=4, D=4096, dtype=torch.float32, seed=T) < 1e-5


@pytest.mark.parametrize("T", [1, 4, 300])  # 300: the mix over 8 parts, each token's collapse in one program
def test_hc_head(T):
    err = check_hc_head(CUDA, T, n=4, D=4096, seed=T)
    print(f"hc_head T={T}: {err:.2e}")
    assert err < BF16_TOL
    assert check_hc_head(CUDA, T, n=4, D=4096, dtype=torch.float32, seed=T) < 1e-5  # fp32 products and sums


def check_hc_pre_fp32(device, T, n, D, seed=0) -> float:
    """`hc_pre` of fp32 streams (fp32 products: the kernels' mix up to SMALL_MIX_TOKENS tokens, cuBLAS's above,
    whose squares hc_pre sums itself) against the reference's: the worst relative error of its three outputs."""
    from deepserve.backends.nvidia.triton_ops.mhc import hc_pre

    g = gen(device, seed)
    streams = torch.randn((T, n, D), generator=g, device=device)
    fn = torch.randn(((2 + n) * n, n * D), generator=g, device=device) * 0.5 / math.sqrt(n * D)
    base = 0.5 * torch.randn((2 + n) * n, generator=g, device=device)
    scale = 1.0 + 0.2 * torch.randn(3, generator=g, device=device)
    got = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, out=poisoned((T, D), torch.float32, device))
    want = ReferenceBackend(device).hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    return max(rel_err(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("T", [1, 300])  # 300: cuBLAS's fp32 mix, whose squares hc_pre sums itself
def test_hc_pre_fp32(T):
    err = check_hc_pre_fp32(CUDA, T, n=4, D=4096, seed=T)
    print(f"hc_pre fp32 T={T}: {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("shape,weighted", [((64, 64, 512), False), ((300, 4096), True), ((7, 1024), True)])
def test_rms_norm(shape, weighted):
    err = check_rms_norm(CUDA, shape, weighted)
    print(f"rms_norm {shape}: rel err {err:.2e}")
    assert err < BF16_TOL


def test_rms_norm_fp32():
    assert check_rms_norm(CUDA, (37, 512), True, dtype=torch.float32) < 1e-5


@pytest.mark.parametrize("H,tiles", [(64, None), (64, dict(block_t=2, block_m=64, num_warps=4)), (1, None)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(inverse, H, tiles):
    err = check_rope(CUDA, 300, H, 512, rope_dim=64, max_pos=32768, inverse=inverse, tiles=tiles)
    print(f"rope inverse={inverse}: rel err {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("ratio,D,overlap", [(4, 512, True), (4, 128, True), (128, 512, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_decode(ratio, D, overlap, dtype):
    err = check_compress_decode(CUDA, 64, ratio, D, overlap, dtype=dtype)
    print(f"compress_decode ratio {ratio} D {D} {dtype}: rel err {err:.2e}")
    assert err < (1e-5 if dtype == torch.float32 else BF16_TOL)


# V4-Flash's packed pools: a CSA and an HCA layer's FP8 rows, the indexer's FP4 keys (exact under the identity turn;
# under the Hadamard matrix only its sum order against torch's matmul may move a nibble)
@pytest.mark.parametrize("ratio,D,overlap,kind,turn", [(4, 512, True, "fp8", None), (128, 512, False, "fp8", None),
                                                       (4, 128, True, "fp4", "identity"),
                                                       (4, 128, True, "fp4", "hadamard")])
def test_compress_decode_packed(ratio, D, overlap, kind, turn):
    share = check_compress_decode_packed(CUDA, 64, ratio, D, overlap, kind, turn=turn or "hadamard")
    print(f"compress_decode {kind} ratio {ratio} D {D} turn {turn}: {share:.2%} of nibbles differ")
    assert share < 0.01


def check_align(device, T, top_k, E, bm, seed=0) -> None:
    """The one-program alignment of a decode step's pairs (`_align_small`) equals the sorted one (`_align`)."""
    from deepserve.backends.nvidia.triton_ops.moe import _align, _align_small

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(device)
    a, b = _align(ids, E, bm), _align_small(ids, E, bm)
    assert a[2] == b[2] and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("T,top_k,E,bm", [(1, 6, 32, 16), (64, 6, 32, 16), (256, 6, 32, 32), (33, 8, 256, 16)])
def test_align_small_equals_align(T, top_k, E, bm):
    check_align(CUDA, T, top_k, E, bm, seed=T)


def check_route(device, T, E, top_k, hashed, seed=0) -> float:
    """`route` (router scores, bias, top-k or hashed ids, normalized weights) against the reference's scores;
    returns the largest weight error."""
    from deepserve.backends.nvidia.triton_ops.moe import route

    g = gen(device, seed)
    logits = torch.randn((T, E), generator=g, device=device) * 3
    logits[0, :4] = 30.0  # softplus's linear branch
    bias = torch.randn(E, generator=g, device=device) * 0.1
    hash_ids = torch.stack([torch.randperm(E, generator=g, device=device)[:top_k] for _ in range(T)]) if hashed else None
    ids, weights = route(logits, None if hashed else bias, hash_ids, top_k, 2.5)
    scores = ReferenceBackend(device).router_scores(logits)
    expect = hash_ids if hashed else torch.topk(scores + bias, top_k, dim=-1).indices
    assert torch.equal(ids.sort(1).values, expect.sort(1).values)
    ref = scores.gather(1, ids)
    ref = ref / (ref.sum(-1, keepdim=True) + 1e-20) * 2.5
    return float((weights - ref).abs().max())


@pytest.mark.parametrize("E,top_k,hashed", [(32, 6, False), (256, 8, False), (32, 6, True)])
def test_route(E, top_k, hashed):
    assert check_route(CUDA, 200, E, top_k, hashed, seed=E) < 1e-6


def check_route_hidden(device, T, D, E, top_k, hashed, seed=0, dtype=torch.bfloat16, parts=None):
    """`route_hidden` against fp32 logits of the same 16-bit values through the reference routing; returns the
    largest weight error. Called twice on one counter (it must leave the counter at zero)."""
    from deepserve.backends.nvidia.triton_ops.moe import route_hidden

    g = gen(device, seed)
    x, w = randn((T, D), g, device, dtype), randn((E, D), g, device, dtype, std=D**-0.5)
    bias = torch.randn(E, generator=g, device=device) * 0.1
    table = torch.stack([torch.randperm(E, generator=g, device=device)[:top_k] for _ in range(50)]) if hashed else None
    tokens = torch.randint(0, 50, (T,), generator=g, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(2):
        ids, weights = route_hidden(x, w, None if hashed else bias, table, tokens, top_k, 1.5, counter, parts)
        assert int(counter.item()) == 0
    ref_b = ReferenceBackend(device)
    scores = ref_b.router_scores(x.float() @ w.float().t())
    expect = table[tokens] if hashed else torch.topk(scores + bias, top_k, dim=-1).indices
    assert torch.equal(ids.sort(1).values, expect.sort(1).values)
    ref = scores.gather(1, ids)
    ref = ref / (ref.sum(-1, keepdim=True) + 1e-20) * 1.5
    return float((weights - ref).abs().max())


@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("hashed", [False, True])
def test_route_hidden(T, hashed):
    assert check_route_hidden(CUDA, T, D=4096, E=32, top_k=6, hashed=hashed, seed=T) < 1e-5


def test_route_hidden_in_a_cuda_graph():
    """Replayed many times from a graph, the counter keeps working (each launch leaves it at zero)."""
    from deepserve.backends.nvidia import NvidiaBackend

    b = NvidiaBackend()
    g = gen(CUDA, 3)
    x, w = randn((2, 4096), g, CUDA), randn((32, 4096), g, CUDA, std=4096**-0.5)
    bias = torch.zeros(32, device=CUDA)
    tokens = torch.zeros(2, dtype=torch.long, device=CUDA)
    eager = b.route_hidden(x, w, bias, None, tokens, 6, 1.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = b.route_hidden(x, w, bias, None, tokens, 6, 1.0)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    assert not b._arrivals.any()
    assert b.route_hidden(randn((17, 4096), g, CUDA), w, bias, None, tokens, 6, 1.0) is None  # > 16 tokens


def check_swiglu(device, T, I, seed=3) -> float:
    """The clamped SwiGLU kernel on strided halves of one gate-up tensor against the reference's."""
    from deepserve.backends.nvidia.triton_ops.elementwise import swiglu

    g = gen(device, seed)
    gate_up = randn((T, 2 * I), g, device, std=6.0)
    gate, up = gate_up[:, :I], gate_up[:, I:]  # strided rows, as the shared expert's halves may be
    out = swiglu(gate, up, 10.0)
    return rel_err(out, ReferenceBackend(device).swiglu(gate.float(), up.float(), 10.0))


def test_swiglu_kernel():
    assert check_swiglu(CUDA, 300, 2048) < BF16_TOL


@pytest.mark.parametrize("K,ratio", [(0, 0), (512, 0), (256, 4), (32, 128)])
def test_decode_key_rows(K, ratio):
    check_decode_key_rows(CUDA, 64, 128, K, 64 if ratio != 128 else 2, ratio=ratio, D=512, seed=K)


@pytest.mark.parametrize("K", [0, 512, 32])
def test_paged_key_rows(K):
    check_paged_key_rows(CUDA, 300, 128, K, 64)


def check_rope_in_place(device, T, H, d, rope_dim, inverse, seed=2) -> None:
    """`inplace=True` rotates the given rows themselves (touching only the rotated dims) to the same values; a
    view that is not contiguous gets a copy."""
    from deepserve.backends.nvidia.triton_ops.elementwise import apply_rope

    g = gen(device, seed)
    x = randn((T, H, d), g, device)
    positions = torch.randint(0, 32768, (T,), generator=g, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    expect = apply_rope(x, positions, inv_freq, inverse)
    y = x.clone()
    out = apply_rope(y, positions, inv_freq, inverse, inplace=True)
    assert out.data_ptr() == y.data_ptr() and torch.equal(out, expect)
    assert torch.equal(apply_rope(x.clone().transpose(0, 1), positions[:H], inv_freq, inverse, inplace=True),
                       apply_rope(x.transpose(0, 1), positions[:H], inv_freq, inverse))  # not contiguous: a copy


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_in_place(inverse):
    check_rope_in_place(CUDA, 300, 64, 512, 64, inverse)


def test_split_bf16_terms_sum_to_fn():
    from deepserve.backends.nvidia.triton_ops.mhc import split_bf16

    fn = torch.randn((24, 16384), device=CUDA) * 0.01
    terms = split_bf16(fn)
    assert terms.dtype == torch.bfloat16 and terms.shape == (3, 24, 16384)
    assert rel_err(terms.double().sum(0), fn) < 1e-7
    assert split_bf16(fn) is terms  # made once
    fn.mul_(2)
    assert rel_err(split_bf16(fn).double().sum(0), fn) < 1e-7  # rebuilt after an in-place write


def check_rope_fp32_long(device, T, H, d, rope_dim, inverse, max_pos=2**20, seed=1) -> float:
    """fp32 rows at positions up to `max_pos` (the first two 0 and max_pos - 1): the kernel's angles and cos/sin
    against torch's, and a strided position column (as the static decode step passes) giving the same bits."""
    from deepserve.backends.nvidia.triton_ops.elementwise import apply_rope

    g = gen(device, seed)
    x = torch.randn((T, H, d), generator=g, device=device)
    positions = torch.randint(0, max_pos, (T,), generator=g, device=device)
    positions[:2] = torch.tensor([0, max_pos - 1])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    out = apply_rope(x, positions[::1], inv_freq, inverse, out=poisoned(x.shape, torch.float32, device))
    ref = ReferenceBackend(device).apply_rope(x, positions, inv_freq, inverse)
    strided = torch.stack((positions, positions), dim=1)[:, 0]  # a column view, as the static decode step passes
    assert torch.equal(apply_rope(x, strided, inv_freq, inverse), out)
    return rel_err(out, ref)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_fp32_at_long_positions(inverse):
    """fp32 rows at positions up to 1M: the kernel's angles and libdevice cos/sin against torch's."""
    assert check_rope_fp32_long(CUDA, 257, 8, 512, 64, inverse) < 1e-6


def test_backend_uses_kernels():
    from deepserve.backends.nvidia import NvidiaBackend

    b = NvidiaBackend()
    assert b.kernels is not None and "triton" in repr(b)


@pytest.mark.parametrize("T", [1, 300])
def test_grouped_linear_writes_groups_in_place(T):
    """The backend's grouped projection (each group's product written into its columns of the [T, G, r] result)
    against the reference's."""
    from deepserve.backends.nvidia import NvidiaBackend

    g = gen(CUDA, T)
    x = randn((T, 8, 4096), g, CUDA)
    w = randn((8, 1024, 4096), g, CUDA, std=4096**-0.5)
    out = NvidiaBackend().grouped_linear(x, w)
    assert out.shape == (T, 8, 1024) and out.is_contiguous()
    assert rel_err(out, ReferenceBackend(CUDA).grouped_linear(x.float(), w.float())) < BF16_TOL


def check_gemv(device, M, N, K, groups, seed=0) -> None:
    """`gemv` / `grouped_gemv` against fp32 products of the same bf16 operands, with K split (arrival counters
    given: the default split, and an uneven one) and whole; NaN-free, the right shape, the counters left zero,
    and a split call repeated gives the same bits."""
    from deepserve.backends.nvidia.triton_ops.gemv import gemv, grouped_gemv

    g = gen(device, seed)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    if groups:
        x, w = randn((M, groups, K), g, device), randn((groups, N, K), g, device, std=K**-0.5)
        ref = torch.einsum("mgk,gnk->mgn", x.float(), w.float())
    else:
        x, w = randn((M, K), g, device), randn((N, K), g, device, std=K**-0.5)
        ref = x.float() @ w.float().t()

    def run(tiles, c):
        return grouped_gemv(x, w, tiles, c) if groups else gemv(x, w, tiles, c)

    for tiles, c in ((None, None), (None, counters), (dict(split=3, BLOCK_K=64), counters)):
        out = run(tiles, c)
        assert out.shape == ref.shape and not torch.isnan(out).any()
        assert rel_err(out, ref) < BF16_TOL, tiles
        assert not counters.any()
        if c is not None:
            assert torch.equal(out, run(tiles, c))


@pytest.mark.parametrize("M", [1, 3, 4])
@pytest.mark.parametrize("N,K,groups", [(4160, 4096, 0), (32768, 1024, 0), (40, 200, 0), (1024, 4096, 8),
                                        (1536, 4096, 0), (4096, 8192, 0)])
def test_gemv(M, N, K, groups):
    check_gemv(CUDA, M, N, K, groups, seed=M * N)


def check_gemv_norm(device, M, N, K, seed=0) -> None:
    """`gemv` with the input RMSNorm fused (`rms_norm_linear`) against `rms_norm` then `gemv`, and the reference."""
    from deepserve.backends.nvidia.triton_ops.elementwise import rms_norm
    from deepserve.backends.nvidia.triton_ops.gemv import gemv

    g = gen(device, seed)
    x, w = randn((M, K), g, device, std=3.0), randn((N, K), g, device, std=K**-0.5)
    norm_w = 1.0 + 0.1 * torch.randn(K, generator=g, device=device)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    got = gemv(x, w, None, counters, norm=(norm_w, 1e-6))
    want = gemv(rms_norm(x, norm_w, 1e-6), w, None, counters)
    ref = ReferenceBackend(device).rms_norm_linear(x.float(), norm_w, 1e-6, w.float())
    assert rel_err(got, want) < BF16_TOL and rel_err(got, ref) < BF16_TOL and not counters.any()


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("N,K", [(32768, 1024), (1536, 4096)])  # q_b, and a split K
def test_gemv_norm(M, N, K):
    check_gemv_norm(CUDA, M, N, K, seed=M * N)


def check_invariant_matmul(device, M, K, N, rows, seed=0) -> float:
    """The batch-invariant GEMM (`invariant.matmul`): the first m rows alone get the bits they get among all M, for
    each m in `rows`, in bf16 and fp32 outputs; returns the whole product's relative error against fp32 products
    of the same bf16 operands."""
    from deepserve.backends.nvidia.triton_ops.invariant import matmul

    g = gen(device, seed)
    x = randn((M, K), g, device)
    w = randn((N, K), g, device, std=K**-0.5)
    full = matmul(x, w)
    for m in rows:
        assert torch.equal(matmul(x[:m], w), full[:m]), m
    assert torch.equal(matmul(x[:7], w, torch.float32), matmul(x, w, torch.float32)[:7])
    return rel_err(full, x.float() @ w.float().t())


@pytest.mark.parametrize("K,N", [(64, 512), (4096, 1024), (7168, 4096)])
def test_invariant_matmul(K, N):
    assert check_invariant_matmul(CUDA, 300, K, N, rows=(1, 2, 5, 16, 63, 64, 65, 129), seed=K) < BF16_TOL


def test_backend_takes_gemv_for_few_rows():
    from deepserve.backends.nvidia import NvidiaBackend

    b = NvidiaBackend()
    w = torch.randn(4096, 1024, device=CUDA, dtype=torch.bfloat16)
    assert b._gemv(torch.randn(1, 1024, device=CUDA, dtype=torch.bfloat16), w)
    assert not b._gemv(torch.randn(5, 1024, device=CUDA, dtype=torch.bfloat16), w)  # cuBLAS from 5 rows
    assert not b._gemv(torch.randn(1, 1024, device=CUDA), w.float())  # fp32: cuBLAS
    assert not b._gemv(torch.randn(1, 1024, device=CUDA, dtype=torch.bfloat16), w[:512])  # narrow
