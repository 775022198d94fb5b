"""Each Triton kernel of the NVIDIA backend against the reference op, on fresh random inputs of V4-Flash shapes.

The oracle is the reference backend run on fp32 copies of the kernel's (bf16) inputs; the kernel must land
within bf16 rounding of it (relative L2 error under 1e-2) and write every output element (outputs are
NaN-poisoned first). The `check_*` functions take the device and shapes, so the same checks run on the CPU under
Triton's interpreter (TRITON_INTERPRET=1) with small shapes.
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
def check_sparse_attention(device, T, H, d, N, window, topk, seed=0, dtype=torch.bfloat16) -> float:
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
    out = sparse_mqa(q, kv, indices, sinks, scale, out=poisoned(q.shape, dtype, device))
    ref = ReferenceBackend(device)._attend(q.float(), kv.float(), indices, sinks, scale)
    if T > 1:
        assert not out[0].any(), "a query with no keys must output zeros"
    return rel_err(out, ref)


def check_indexer(device, T, Hi, Di, rows_per_seq, topk, seed=0) -> tuple[float, float]:
    """Returns (relative error of the scores, fraction of the reference's top-k the kernel also chose)."""
    from deepserve.backends.nvidia.triton_ops.indexer import indexer_scores, indexer_topk

    g = gen(device, seed)
    q = randn((T, Hi, Di), g, device)
    weights = torch.randn((T, Hi), generator=g, device=device) * Hi**-0.5
    keys = randn((T * rows_per_seq, Di), g, device)
    key_start = torch.arange(T, device=device) * rows_per_seq
    key_count = torch.randint(0, rows_per_seq + 1, (T,), generator=g, device=device)
    key_count[0] = rows_per_seq
    width = int(key_count.max())
    scores = indexer_scores(q, weights, keys, key_start, key_count, width, out=poisoned((T, width), torch.float32, device))
    offs = torch.arange(width, device=device)
    visible = offs[None, :] < key_count[:, None]
    k = keys[(key_start[:, None] + offs[None, :]).clamp(max=keys.shape[0] - 1)].double()
    ref_scores = (torch.relu(torch.einsum("thd,twd->thw", q.double(), k)) * weights.double()[:, :, None]).sum(1)
    ref_scores = ref_scores.masked_fill(~visible, float("-inf"))
    assert torch.equal(torch.isinf(scores), ~visible)
    err = rel_err(scores[visible], ref_scores[visible])
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


def check_hc(device, T, n, D, iters=20, seed=0) -> tuple[float, float, float, float]:
    """Relative errors of hc_pre's (collapsed, post, comb) and of hc_post."""
    from deepserve.backends.nvidia.triton_ops.mhc import hc_post, hc_pre

    g = gen(device, seed)
    streams = randn((T, n, D), g, device)
    fn = torch.randn(((2 + n) * n, n * D), generator=g, device=device) * 0.5 / math.sqrt(n * D)
    base = 0.5 * torch.randn((2 + n) * n, generator=g, device=device)
    scale = 1.0 + 0.2 * torch.randn(3, generator=g, device=device)
    ref_b = ReferenceBackend(device)
    mix = torch.mm(streams.flatten(1).float(), fn.t())
    x, post, comb = hc_pre(streams, mix, base, scale, iters, 1e-6, 1e-6, out=poisoned((T, D), torch.bfloat16, device))
    rx, rpost, rcomb = ref_b.hc_pre(streams.float(), fn, base, scale, iters, 1e-6, 1e-6)
    y = randn((T, D), g, device)
    new = hc_post(streams, y, post, comb, out=poisoned(streams.shape, torch.bfloat16, device))
    rnew = ref_b.hc_post(streams.float(), y.float(), rpost, rcomb)
    return rel_err(x, rx), rel_err(post, rpost), rel_err(comb, rcomb), rel_err(new, rnew)


def check_rms_norm(device, shape, weighted, dtype=torch.bfloat16, seed=0) -> float:
    from deepserve.backends.nvidia.triton_ops.elementwise import rms_norm

    g = gen(device, seed)
    x = randn(shape, g, device, dtype, std=3.0)
    w = 1.0 + 0.1 * torch.randn(shape[-1], generator=g, device=device) if weighted else None
    out = rms_norm(x, w, 1e-6, out=poisoned(shape, dtype, device))
    return rel_err(out, ReferenceBackend(device).rms_norm(x.float(), w, 1e-6))


def check_rope(device, T, H, d, rope_dim, max_pos, inverse, seed=0) -> float:
    from deepserve.backends.nvidia.triton_ops.elementwise import apply_rope

    g = gen(device, seed)
    x = randn((T, H, d), g, device)
    positions = torch.randint(0, max_pos, (T,), generator=g, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=device).float() / rope_dim))
    out = apply_rope(x, positions, inv_freq, inverse, out=poisoned(x.shape, torch.bfloat16, device))
    ref = ReferenceBackend(device).apply_rope(x.float(), positions, inv_freq, inverse)
    assert torch.equal(out[..., : d - rope_dim], x[..., : d - rope_dim]), "the unrotated dims changed"
    return rel_err(out, ref)


# -- the tests, at V4-Flash shapes ------------------------------------------------------------------------------------
CUDA = "cuda"


@pytest.mark.parametrize("T", [1, 64, 2048])
def test_sparse_attention(T):
    # 64 heads of 512 over one K=V head; window 128 + top-512 compressed rows
    err = check_sparse_attention(CUDA, T, 64, 512, N=8192, window=128, topk=512, seed=T)
    print(f"sparse_attention T={T}: rel err {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("T", [1, 64, 256])  # the reference materialises [T, 64, 2048, 128] fp32
def test_indexer(T):
    err, overlap = check_indexer(CUDA, T, 64, 128, rows_per_seq=2048, topk=512, seed=T)
    print(f"indexer T={T}: scores rel err {err:.2e}, top-k overlap {overlap:.4f}")
    assert err < 1e-3  # bf16 products summed in fp32
    assert overlap > 0.98  # only near-ties at the cut may differ


@pytest.mark.parametrize("T", [1, 64, 1000])
def test_moe_experts(T):
    err = check_moe(CUDA, T, D=4096, I=2048, E=32, top_k=6, seed=T)
    print(f"moe_experts T={T}: rel err {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("T", [1, 300])
def test_hc(T):
    x, post, comb, new = check_hc(CUDA, T, n=4, D=4096, seed=T)
    print(f"hc T={T}: collapsed {x:.2e}, post {post:.2e}, comb {comb:.2e}, hc_post {new:.2e}")
    assert x < BF16_TOL and new < BF16_TOL
    assert post < 1e-5 and comb < 1e-5  # fp32 throughout


@pytest.mark.parametrize("shape,weighted", [((64, 64, 512), False), ((300, 4096), True), ((7, 1024), True)])
def test_rms_norm(shape, weighted):
    err = check_rms_norm(CUDA, shape, weighted)
    print(f"rms_norm {shape}: rel err {err:.2e}")
    assert err < BF16_TOL


def test_rms_norm_fp32():
    assert check_rms_norm(CUDA, (37, 512), True, dtype=torch.float32) < 1e-5


@pytest.mark.parametrize("inverse", [False, True])
def test_rope(inverse):
    err = check_rope(CUDA, 300, 64, 512, rope_dim=64, max_pos=32768, inverse=inverse)
    print(f"rope inverse={inverse}: rel err {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_fp32_at_long_positions(inverse):
    """fp32 rows at positions up to 1M: the kernel's angles and libdevice cos/sin against torch's."""
    from deepserve.backends.nvidia.triton_ops.elementwise import apply_rope

    g = gen(CUDA, 1)
    x = torch.randn((257, 8, 512), generator=g, device=CUDA)
    positions = torch.randint(0, 2**20, (257,), generator=g, device=CUDA)
    positions[:2] = torch.tensor([0, 2**20 - 1])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=CUDA).float() / 64))
    out = apply_rope(x, positions[::1], inv_freq, inverse, out=poisoned(x.shape, torch.float32, CUDA))
    ref = ReferenceBackend(CUDA).apply_rope(x, positions, inv_freq, inverse)
    assert rel_err(out, ref) < 1e-6
    strided = torch.stack((positions, positions), dim=1)[:, 0]  # a column view, as the static decode step passes
    assert torch.equal(apply_rope(x, strided, inv_freq, inverse), out)


def test_backend_uses_kernels():
    from deepserve.backends.nvidia import NvidiaBackend

    b = NvidiaBackend()
    assert b.kernels is not None and "triton" in repr(b)
