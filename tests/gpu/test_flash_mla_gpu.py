"""FlashMLA's SM90 sparse decode over the FP8 KV pools (`backends/nvidia/vendor.py`, `FlashMlaDecode`), where the
wheel of `scripts/build_vendor_kernels.sh` is installed (`bench/gpu_call.sh` installs what travels in `.whl/`):
against the Triton packed-row kernel (the oracle it is checked against at first use) and the reference over the
decoded rows at V4-Flash and V4-Pro head counts; the backend's op with its RoPE turn, in a CUDA graph; and an
engine on a V4-Flash-shaped random checkpoint with the FP8 KV cache, FlashMLA against the Triton kernel.
tests/test_flash_mla_layout.py checks the byte contract and the call on the CPU."""

from __future__ import annotations

import pytest
import torch

from test_kv_fp8_triton import attention_case, packed_kv_rows, rel_err

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
flash_mla = pytest.importorskip("flash_mla")

D, ROPE = 512, 64


@pytest.fixture(scope="module")
def decode():
    from deepserve.backends.nvidia.vendor import FlashMlaDecode

    loaded = FlashMlaDecode.load(torch.cuda.current_device())
    assert loaded is not None, "flash_mla imports but is not used on this GPU"
    return loaded


# a batch-1 and a batch-64 decode step, a verify step's rows, a prompt chunk; the window plus a CSA layer's top-512
# (640), an HCA layer's many compressed rows (4224), a K that is not a multiple of 64
@pytest.mark.parametrize("T, K", [(1, 640), (64, 640), (256, 200), (2048, 640), (2, 4224)])
@pytest.mark.parametrize("H", [64, 128])
def test_flash_mla_against_the_triton_packed_kernel(decode, T, H, K):
    from deepserve.backends.nvidia.triton_ops import packed_kv
    from deepserve.backends.reference import ReferenceBackend

    g = torch.Generator().manual_seed(T + K + H)
    codec, stored = packed_kv_rows(20000, D, ROPE, torch.bfloat16, g, "cuda")
    q, indices, sinks, _, _ = attention_case(T, H, D, ROPE, 20000, K, torch.bfloat16, g, "cuda")
    scale = D ** -0.5
    assert decode.takes(q, stored, codec)
    out = decode.attend(q, stored, indices, sinks, scale)
    triton_out = packed_kv.sparse_mqa_packed(q, stored, codec.nope, indices, sinks, scale)
    ref = ReferenceBackend("cuda", exact=False).sparse_attention(q.float(), codec.decode(stored).float(), indices,
                                                                 sinks, scale)
    if T > 1:  # query 0 sees no row: only the sink
        assert not out[0].any()
    errors = rel_err(out, ref), rel_err(triton_out, ref), rel_err(out, triton_out)
    print(f"T={T} H={H} K={K}: FlashMLA {errors[0]:.2e}, Triton {errors[1]:.2e} against the reference; "
          f"FlashMLA against Triton {errors[2]:.2e}")
    assert errors[0] < 1e-2 and errors[2] < decode.TOLERANCE


def test_the_backend_takes_flash_mla_in_graphs():
    """`sparse_attention_packed` (RoPE turn included) through FlashMLA against the Triton kernel's, and a CUDA graph
    of it replayed on new queries equal to the eager call."""
    from deepserve.backends.nvidia import NvidiaBackend

    backend = NvidiaBackend("cuda")
    assert backend.flash_mla is not None and "flash_mla" in repr(backend)
    g = torch.Generator().manual_seed(5)
    codec, stored = packed_kv_rows(5000, D, ROPE, torch.bfloat16, g, "cuda")
    q, indices, sinks, positions, inv_freq = attention_case(64, 64, D, ROPE, 5000, 640, torch.bfloat16, g, "cuda")
    args = (stored, codec, indices, sinks, D ** -0.5, positions, inv_freq)
    out = backend.sparse_attention_packed(q, *args)
    assert backend.flash_mla.checked == {64: True}
    flash_mla_fn, backend.flash_mla = backend.flash_mla, None
    triton_out = backend.sparse_attention_packed(q, *args)
    backend.flash_mla = flash_mla_fn
    assert rel_err(out, triton_out) < flash_mla_fn.TOLERANCE
    static_q = q.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.sparse_attention_packed(static_q, *args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.sparse_attention_packed(static_q, *args)
    new_q = torch.randn(q.shape, generator=g).to("cuda", q.dtype)
    static_q.copy_(new_q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, backend.sparse_attention_packed(new_q, *args))


def test_engine_with_flash_mla_against_the_triton_kernel(tmp_path, monkeypatch):
    """A V4-Flash-shaped random checkpoint (64 heads of 512 dims, 6 layers) with the FP8 KV cache and CUDA graphs:
    its prompt logprobs with FlashMLA's attention against the Triton kernel's, and FlashMLA taking the steps."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.startup import write_checkpoint
    from deepserve import LLM, SamplingParams
    from deepserve.backends.nvidia import vendor

    checkpoint = write_checkpoint(tmp_path / "flash", experts=8, quick=False)
    prompt = {"prompt_token_ids": [(37 * i + 11) % 5000 + 30 for i in range(700)]}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    calls, runs = [0], {}
    attend = vendor.FlashMlaDecode.attend

    def counted(self, *a, **kw):
        calls[0] += 1
        return attend(self, *a, **kw)

    monkeypatch.setattr(vendor.FlashMlaDecode, "attend", counted)
    for use in (True, False):
        if not use:
            monkeypatch.setattr(vendor.FlashMlaDecode, "load", classmethod(lambda cls, index: None))
        llm = LLM(model=str(checkpoint), accelerator="nvidia", dtype="bfloat16", kv_cache_dtype="fp8",
                  block_size=256, max_model_len=2048, max_num_seqs=8)
        assert (llm.backend.flash_mla is not None) == use
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        ids = prompt["prompt_token_ids"]
        runs[use] = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])
        del llm
        torch.cuda.empty_cache()
    assert calls[0] > 0
    diff = (runs[True] - runs[False]).abs()
    print(f"prompt logprobs, FlashMLA against Triton: max {diff.max():.3g}, mean {diff.mean():.3g}")
    assert diff.max() < 0.5 and diff.mean() < 0.05
