"""The kernels that read the FP8 KV cache's packed rows (`triton_ops/packed_kv.py`) at V4-Flash shapes on a GPU,
against the decoded rows and the reference ops; the NVIDIA backend's packed-row ops against their decoding fallback;
and an engine with CUDA graphs over packed pools, its packed reads against the fallback. The `check_*` functions
are tests/test_kv_fp8_triton.py's (there under the interpreter, small shapes).

V4-Flash: KV rows of 512 dims (448 FP8 + 64 bf16 RoPE, 592 bytes), 64 query heads; indexer keys of 128 values
(68 bytes), 64 indexer heads, 64 keys a page (256 tokens at ratio 4), top-512.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepserve import LLM, SamplingParams
from test_kv_fp8_triton import (check_packed_index_scores, check_packed_kv_ops, check_sparse_mqa_packed,
                                check_store_rows, kernel_calls)

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels():
    from deepserve.backends.nvidia.triton_ops import packed_kv, packed_writes

    return SimpleNamespace(packed_kv=packed_kv, packed_writes=packed_writes)


# queries: a batch-1 decode step (the list split over programs), a batch-64 step, a prompt chunk; keys: the window
# (128) plus a CSA layer's top-512, or an HCA layer's many compressed rows
@pytest.mark.parametrize("T, K", [(1, 640), (4, 640), (64, 640), (2048, 640), (2, 4224)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_over_packed_rows(kernels, T, K, dtype):
    check_sparse_mqa_packed(kernels, "cuda", T, 64, 512, 64, N=20000, K=K, dtype=dtype)


@pytest.mark.parametrize("splits", [1, 2, 16])
def test_attention_over_packed_rows_in_parts(kernels, splits):
    check_sparse_mqa_packed(kernels, "cuda", 3, 64, 512, 64, N=5000, K=1000, dtype=torch.bfloat16, splits=splits)


# a fixed-shape decode step (one table row per query) at batch 1 and 64; a prompt chunk's queries over 4 sequences'
# tables
@pytest.mark.parametrize("T, B, P, query_rows", [(1, 1, 64, False), (64, 64, 16, False), (512, 4, 32, True)])
def test_index_scores_over_packed_pages(kernels, T, B, P, query_rows):
    check_packed_index_scores(kernels, "cuda", T, B, 64, 128, P, num_pages=300, rpp=64, dtype=torch.bfloat16,
                              query_rows=query_rows)


# the write kernels' bytes against the codecs' (e4m3 / e2m1 / bf16 rounding on the device): V4-Flash's rows and keys,
# a decode step's 64 and a prompt chunk's 4,096, fp32 and bf16 inputs; the tiny model's short blocks
@pytest.mark.parametrize("kind, width, rope", [("fp8", 512, 64), ("fp4", 128, 0), ("fp8", 32, 16), ("fp4", 16, 0)])
@pytest.mark.parametrize("n", [64, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_writes_are_the_codecs_bytes(kernels, kind, width, rope, n, dtype):
    check_store_rows(kernels, "cuda", kind, width, rope, dtype=dtype, n=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", [False, True])
def test_backend_ops_against_their_decoding_fallback(dtype, invariant):
    from deepserve.backends.nvidia import NvidiaBackend

    check_packed_kv_ops(NvidiaBackend("cuda", invariant=invariant), "cuda", dtype)


def fp8_demo_runs(tmp_path, monkeypatch, flag: str) -> list[tuple[list[int], list[torch.Tensor], dict]]:
    """The demo model in bf16 with CUDA graphs (the static layout's fixed-shape step) over packed pools, with
    `PackedKVOps.<flag>` on then off, each in a fresh engine (set before it is built: the graphs capture what it
    chooses): per run its greedy tokens, every pool's bytes and the packed kernels' Python calls."""
    from deepserve.backends.nvidia.packed_kv import PackedKVOps
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    checkpoint = build_demo_checkpoint(tmp_path / "demo")
    prompt = {"prompt_token_ids": [(37 * i + 11) % 240 + 30 for i in range(300)]}  # ids < the vocabulary (274)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(PackedKVOps, flag, on)
        llm = LLM(model=checkpoint, accelerator="nvidia", dtype="bfloat16", kv_cache_dtype="fp8", block_size=128)
        assert llm.graphs is not None
        with kernel_calls() as calls:
            tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        pools = [t.cpu() for layer in llm.cache.layers
                 for t in (layer.storage, layer.snap_window, getattr(layer.indexer, "rows", None)) if t is not None]
        runs.append((tokens, pools, calls))
    return runs


def test_engine_with_graphs_reads_packed_rows_as_the_fallback_does(tmp_path, monkeypatch):
    """The same greedy tokens with the packed reads as with the decoding fallback (graphs captured either way)."""
    (packed, _, calls), (fallback, _, no_calls) = fp8_demo_runs(tmp_path, monkeypatch, "read_packed")
    # (graph replays launch without Python calls: the eager prefill's count)
    assert calls["indexer"] > 0 and no_calls["indexer"] == 0, (calls, no_calls)
    assert packed == fallback


def test_engine_with_graphs_writes_packed_rows_as_torch_ops_do(tmp_path, monkeypatch):
    """The same greedy tokens with the write kernels as with the codecs' torch ops, the same rows written, and
    the same bytes but for rounding flips. (Bit-equal pools held under the interpreter; on the H100 two engine
    runs differ upstream of the encoding, as the default mode's runs do: bench/investigations/determinism.py,
    so an input a hair apart may round to the neighbouring code. The kernels' bytes equal the codecs' on the
    same inputs: test_packed_writes_are_the_codecs_bytes.)"""
    (tokens, pools, _), (torch_tokens, torch_pools, _) = fp8_demo_runs(tmp_path, monkeypatch, "write_packed")
    assert tokens == torch_tokens
    for i, (a, b) in enumerate(zip(pools, torch_pools)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        rows_a, rows_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        written = rows_a.view(torch.uint8).ne(0).any(1)
        assert torch.equal(written, rows_b.view(torch.uint8).ne(0).any(1)), f"pool {i}: other rows written"
        differ = a.view(torch.uint8).ne(b.view(torch.uint8)).float().mean().item()
        assert differ < 0.01, f"pool {i}: {differ:.2%} of its bytes differ"
