"""The FP8 KV cache (`kv_cache_dtype="fp8"`, docs/quantization.md) on an NVIDIA GPU: the rounding on the device
against the CPU emulation at V4-Flash's row shapes (bit for bit: e4m3 / e2m1 codes times powers of two), and the
engine on the NVIDIA backend (Triton attention and indexer kernels, CUDA graphs) in fp8 mode against its bf16 KV
cache, against itself without graphs, and against the reference backend's fp8 mode.

The rows are rounded where they are made (`Attention.forward`, `_Pooler.rows`) and the pools keep them packed
(`kv_precision.FP8Rows`: e4m3 codes, bf16 RoPE dims and UE8M0 scale bytes; `FP4Keys`: e2m1 nibbles and scale
bytes): the indexer's kernel reads the FP4 key pages as stored (`triton_ops/packed_kv.py`) and the attention reads
the rows a step gathers (packed as stored where the layouts pass them through `Backend.sparse_attention_packed`,
else decoded first); the fixed-shape decode step takes the unfused compressor path in fp8 mode
(`layouts.static.emit_static`). These tests check those paths on the device; tests/gpu/test_kv_fp8_kernels.py
checks the packed-row kernels themselves."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.model.kv_precision import KVPrecision, fp4_roundtrip, fp8_roundtrip, hadamard

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

#: the embedded model's bounds of tests/test_kv_fp8.py (fp32 there: measured max 0.074, mean 0.0063), loosened for
#: the bf16 model's own noise in both runs
LOGPROB_BOUND = 0.2
LOGPROB_MEAN_BOUND = 0.03
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(150)]  # for the tiny random model


def test_rounding_on_the_device_equals_the_cpu_emulation():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4096, 512, generator=g) * torch.logspace(-4, 2, 512)
    p = KVPrecision("fp8", rope_dims=64)
    for dtype in (torch.float32, torch.bfloat16):
        x = rows.to(dtype)
        assert torch.equal(p.round_kv(x.cuda()).cpu(), p.round_kv(x))
    assert torch.equal(fp8_roundtrip(rows.cuda()).cpu(), fp8_roundtrip(rows))
    keys = hadamard(torch.randn(4096, 128, generator=g))  # turned once, so that both sides round the same values
    assert torch.equal(fp4_roundtrip(keys.cuda()).cpu(), fp4_roundtrip(keys))
    assert torch.allclose(hadamard(keys.cuda()).cpu(), hadamard(keys), atol=1e-5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import tiny

    return tiny.save_hf_checkpoint(tiny.make_hf_model(seed=0), tmp_path_factory.mktemp("tiny-kv-fp8-gpu"))


def _run(llm, prompt=PROMPT, max_tokens=16):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def _prompt_logprobs(out, prompt=PROMPT):
    return torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])


def test_engine_fp8_against_bf16_kv_on_nvidia():
    from test_kv_fp8 import EMBEDDED, TEXT

    bf16_llm = LLM(EMBEDDED, accelerator="nvidia", block_size=128)
    prompt = bf16_llm.tokenizer.encode(TEXT)
    bf16 = _run(bf16_llm, prompt)
    fp8_llm = LLM(EMBEDDED, accelerator="nvidia", block_size=128, kv_cache_dtype="fp8")
    assert fp8_llm.graphs is not None  # the decode steps replay CUDA graphs with the rounding inside
    fp8 = _run(fp8_llm, prompt)
    diff = (_prompt_logprobs(bf16, prompt) - _prompt_logprobs(fp8, prompt)).abs()
    print(f"fp8 KV against bf16 KV on the GPU: max {diff.max():.4f}, mean {diff.mean():.4f}")
    assert diff.max() < LOGPROB_BOUND and diff.mean() < LOGPROB_MEAN_BOUND and diff.max() > 0
    checked = 0
    for ref, got in zip(bf16.prompt_logprobs[1:], fp8.prompt_logprobs[1:]):  # greedy, teacher-forced
        top = sorted(ref.items(), key=lambda kv: -kv[1].logprob)
        if top[0][1].logprob - top[1][1].logprob >= 2 * LOGPROB_BOUND:
            assert max(got.items(), key=lambda kv: kv[1].logprob)[0] == top[0][0]
            checked += 1
    assert checked >= 30


def test_fp8_graphs_equal_eager_and_the_reference(tiny_dir):
    """fp32 on the GPU, graphs on and off, against the CPU reference backend in fp8 mode: the same rows rounded
    the same way, so only the kernels' float noise separates them (fp32: far below the fp8 effect)."""
    runs = {}
    for name, kw in (("graphs", dict(accelerator="nvidia")), ("eager", dict(accelerator="nvidia", enforce_eager=True)),
                     ("reference", dict(accelerator="cpu"))):
        runs[name] = _run(LLM(tiny_dir, dtype="float32", block_size=128, kv_cache_dtype="fp8", **kw))
    assert runs["graphs"].outputs[0].token_ids == runs["eager"].outputs[0].token_ids
    ref = _prompt_logprobs(runs["reference"])
    for name in ("graphs", "eager"):
        diff = (_prompt_logprobs(runs[name]) - ref).abs()
        print(f"fp8 {name} against the reference's fp8: max {diff.max():.2e}")
        assert diff.max() < 5e-2  # an fp32 row that lands on the other side of an e4m3 midpoint moves a little
