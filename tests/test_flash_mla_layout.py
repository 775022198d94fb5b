"""FlashMLA's sparse decode reads the FP8 KV pools in place (`backends/nvidia/vendor.py`, `FlashMlaDecode`): on the
CPU, the byte contract and the call's marshalling, against a stand-in for `flash_mla` that keeps the checks its
interface makes (`csrc/api/sparse_decode.h` at 9241ae3: dtypes, shapes, the MODEL1 token size and block
contiguity, K in blocks of 64, 64 or 128 heads) and reads a token's bytes at the addresses its SM90 kernel forms
(values and RoPE values at block * block stride + offset * 576, the block's scales after all its tokens' values).
The kernel itself runs in tests/gpu/test_flash_mla_gpu.py."""

from __future__ import annotations

import pytest
import torch

from deepserve.backends.nvidia.vendor import FlashMlaDecode
from deepserve.backends.reference import ReferenceBackend
from deepserve.model.kv_precision import KVPrecision

NOPE, ROPE, D = 448, 64, 512


def model1_rows(kv: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows FlashMLA's MODEL1 kernel reads for `indices` (>= 0) from its cache view `kv` [blocks, block size,
    1, 584], as fp32 [n, 512]: the bytes addressed from the tensor's storage as the kernel does (not through the
    view's shape), e4m3 codes times their UE8M0 scale, then the bf16 RoPE values."""
    flat = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())[kv.storage_offset():]
    block_size, stride = kv.shape[1], kv.stride(0)
    out = []
    for index in indices.tolist():
        block, offset = divmod(index, block_size)
        base = block * stride + offset * (NOPE + 2 * ROPE)
        values = flat[base : base + NOPE].view(torch.float8_e4m3fn).float()
        rope = flat[base + NOPE : base + NOPE + 2 * ROPE].view(torch.bfloat16).float()
        at = block * stride + block_size * (NOPE + 2 * ROPE) + offset * 8
        scales = (flat[at : at + 7].to(torch.int32) << 23).view(torch.float32)  # e8m0: the exponent field
        out.append(torch.cat([(values.view(7, 64) * scales[:, None]).flatten(), rope]))
    return torch.stack(out) if out else torch.zeros(0, D)


class FakeFlashMLA:
    """`flash_mla`'s two functions as deepserve calls them, with the interface's checks; attention in fp32 over the
    rows `model1_rows` reads. `broken`: "raise" (a failing kernel) or "zeros" (a wrong one)."""

    def __init__(self, broken: str | None = None) -> None:
        self.broken, self.calls = broken, 0

    def get_mla_metadata(self):
        return object(), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits=None,
                               softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                               attn_sink=None, **extra):
        self.calls += 1
        if self.broken == "raise":
            raise RuntimeError("no kernel image is available for execution on the device")
        assert block_table is None and cache_seqlens is None and not causal and is_fp8_kvcache and not extra
        b, s_q, h_q, d_qk = q.shape
        assert q.dtype == torch.bfloat16 and q.stride(-1) == 1 and (d_qk, head_dim_v) == (D, D) and h_q in (64, 128)
        assert k_cache.dim() == 4 and k_cache.dtype == torch.uint8 and k_cache.shape[2:] == (1, NOPE + 2 * ROPE + 8)
        assert k_cache.stride(1) == NOPE + 2 * ROPE + 8 and k_cache.stride(-1) == 1  # "the whole block contiguous"
        assert k_cache.stride(0) % 16 == 0 and k_cache.data_ptr() % 16 == 0  # its 16-byte loads
        assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q) and indices.shape[2] % 64 == 0
        assert (indices >= -1).all()  # the kernel skips -1 only; another negative index is read as a row
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,) and attn_sink.is_contiguous()
        out = torch.zeros(b, s_q, h_q, head_dim_v)
        for i in range(b):
            for j in range(s_q):
                chosen = indices[i, j][indices[i, j] != -1]
                if chosen.numel() == 0:
                    continue
                rows = model1_rows(k_cache, chosen)
                scores = q[i, j].float() @ rows.T * softmax_scale
                lse = torch.logsumexp(scores, dim=-1)
                out[i, j] = torch.softmax(scores, dim=-1) @ rows * torch.sigmoid(lse - attn_sink)[:, None]
        if self.broken == "zeros":
            out.zero_()
        return out.to(torch.bfloat16), None


def pool(N: int, g: torch.Generator, dtype=torch.bfloat16):
    """(codec, rows' values [N, 512] as stored, storage [N, stored bytes]) with widely ranging magnitudes."""
    codec = KVPrecision("fp8", rope_dims=ROPE).kv_codec(D, dtype)
    rows = (torch.randn(N, D, generator=g) * torch.logspace(-2, 1, D)[torch.randperm(D, generator=g)]).to(dtype)
    storage = codec.encode(rows)
    return codec, codec.decode(storage), storage


def case(T: int, H: int, N: int, K: int, g: torch.Generator):
    q = torch.randn(T, H, D, generator=g).bfloat16()
    indices = torch.randint(0, N, (T, K), generator=g)
    indices[torch.rand(T, K, generator=g) < 0.25] = -1
    return q, indices, torch.randn(H, generator=g)


def test_a_packed_row_is_a_model1_block_read_in_place():
    g = torch.Generator().manual_seed(0)
    codec, values, storage = pool(40, g)
    assert storage.shape == (40, 592) and storage.stride(0) % 16 == 0  # rows padded to 16 bytes (584 -> 592)
    assert FlashMlaDecode.takes(torch.zeros(2, 64, D, dtype=torch.bfloat16), storage, codec)
    kv = FlashMlaDecode.kv_view(storage)
    assert kv.shape == (40, 1, 1, 584) and kv.stride()[:2] == (592, 584) and kv.data_ptr() == storage.data_ptr()
    picked = torch.tensor([0, 39, 7, 7, 21])
    assert torch.equal(model1_rows(kv, picked), values[picked].float())  # bit for bit what the codec decodes
    # a pool FlashMLA cannot read in place is left to the Triton kernel
    q64 = torch.zeros(2, 64, D, dtype=torch.bfloat16)
    flat = torch.zeros(41 * 592, dtype=torch.uint8)
    misaligned = flat[8 : 8 + 40 * 592].view(40, 592)
    assert not FlashMlaDecode.takes(q64, misaligned, codec)
    assert not FlashMlaDecode.takes(q64, torch.zeros(40, 584, dtype=torch.uint8), codec)  # 8-byte rows
    assert not FlashMlaDecode.takes(q64.float(), storage, KVPrecision("fp8", ROPE).kv_codec(D, torch.float32))
    assert not FlashMlaDecode.takes(torch.zeros(2, 32, D, dtype=torch.bfloat16), storage, codec)  # 32 heads
    small = KVPrecision("fp8", rope_dims=16).kv_codec(32, torch.bfloat16)  # the tiny model's rows
    assert not FlashMlaDecode.takes(torch.zeros(2, 64, 32, dtype=torch.bfloat16), small.encode(torch.ones(4, 32)), small)


@pytest.mark.parametrize("T,H,K", [(1, 64, 64), (5, 64, 100), (3, 128, 160)])
def test_flash_mla_decode_is_the_sparse_attention_over_the_decoded_rows(T, H, K):
    g = torch.Generator().manual_seed(T * H + K)
    codec, values, storage = pool(300, g)
    q, indices, sinks = case(T, H, 300, K, g)
    if T > 1:
        indices[0] = -1  # a query that sees no row: only the sink
        indices[1, ::3] = -7  # any negative entry is "none"
    fake = FakeFlashMLA()
    out = FlashMlaDecode(fake).attend(q, storage, indices, sinks, D ** -0.5)
    ref = ReferenceBackend().sparse_attention(q.float(), values.float(), indices, sinks, D ** -0.5)
    assert out.shape == (T, H, D) and out.dtype == torch.bfloat16 and fake.calls == 1
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-3)


def test_the_first_call_is_checked_and_a_failing_kernel_is_dropped():
    g = torch.Generator().manual_seed(1)
    codec, values, storage = pool(50, g)
    q, indices, sinks = case(2, 64, 50, 70, g)
    oracle_calls = []

    def oracle(q, storage, indices, sinks, scale):
        oracle_calls.append(q.shape)
        return ReferenceBackend().sparse_attention(q.float(), codec.decode(storage).float(), indices, sinks,
                                                   scale).to(q.dtype)

    good = FlashMlaDecode(FakeFlashMLA())
    first = good(q, storage, codec, indices, sinks, 0.05, oracle)
    again = good(q, storage, codec, indices, sinks, 0.05, oracle)
    assert first is not None and torch.equal(first, again) and good.checked == {64: True}
    assert len(oracle_calls) == 1  # once per head count, on its own random rows
    for broken in ("raise", "zeros"):
        dropped = FlashMlaDecode(FakeFlashMLA(broken))
        assert dropped(q, storage, codec, indices, sinks, 0.05, oracle) is None and dropped.checked == {64: False}
        assert dropped(q, storage, codec, indices, sinks, 0.05, oracle) is None and dropped.fm.calls == 1
    # shapes it does not take never reach it, nor steps of more queries than it takes (prompt chunks)
    small = FlashMlaDecode(FakeFlashMLA())
    assert small(q[:, :32], storage, codec, indices, sinks, 0.05, oracle) is None and small.fm.calls == 0
    long = q[:1].expand(FlashMlaDecode.MAX_QUERIES + 1, -1, -1)
    assert small(long, storage, codec, indices[:1].expand(long.shape[0], -1), sinks, 0.05, oracle) is None
    assert small.fm.calls == 0
