"""The FP8 KV cache (`kv_cache_dtype`, docs/quantization.md): the rounding against the weight quantizers of
`deepserve.model.quant` (an independent implementation of the same e4m3 / e2m1 block formats), the stored-form
byte accounting at V4-Flash's shapes, and the engine in fp8 mode against the model dtype and against itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepserve
from deepserve import LLM, SamplingParams
from deepserve.core.config import EngineConfig
from deepserve.model import quant
from deepserve.model.kv_cache import specs_bytes_per_page
from deepserve.model.kv_precision import KVPrecision, fp4_roundtrip, fp8_roundtrip, hadamard
from deepserve.model.state import LayerStateSpec, StreamSpec

#: how far a prompt token's logprob may move when the KV cache goes from fp32 to fp8, on the embedded (trained)
#: model: at most LOGPROB_BOUND, LOGPROB_MEAN_BOUND on average (measured on TEXT's 221 tokens with v2: max 0.385 at
#: one position, mean 0.012; a bf16 cache: 0.028 / 0.0022; v1 had 0.074 / 0.0063); greedy (top-1) tokens equal
#: wherever the fp32 top-2 margin is at least GREEDY_MARGIN (161 positions; 218 of 220 agree overall).
LOGPROB_BOUND = 0.5
GREEDY_MARGIN = 0.2
LOGPROB_MEAN_BOUND = 0.02
EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
TEXT = ("The history of the city begins with a small settlement on the river. Over the centuries it grew into a "
        "market town, and later a port; its old bridge, its cathedral and its university still stand. ") * 3


def test_fp8_rows_match_the_block_quantizer_with_power_of_two_scales():
    x = torch.randn(37, 448, dtype=torch.float64).float() * torch.logspace(-3, 3, 448)
    # the weight quantizer with 1 x 64 blocks is the same format: e4m3 codes, one UE8M0 scale per 64 values
    codes, scales = quant.quantize_fp8(x, block=(1, 64))
    want = quant.dequantize_fp8(codes, scales, block=(1, 64))
    got = fp8_roundtrip(x)
    assert torch.equal(got, want)
    assert torch.equal(fp8_roundtrip(got), got)  # a rounded row is on the grid already
    # each block's scale is the smallest power of two that puts its amax within e4m3's range
    amax = x.view(37, 7, 64).abs().amax(-1)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448)))
    assert (amax / scale <= 448).all() and (amax / scale > 224).all()
    err = (got - x).abs().view(37, 7, 64)
    assert (err <= torch.maximum(x.view(37, 7, 64).abs() / 16, scale[..., None] * 2.0**-10)).all()


def test_fp4_keys_match_the_expert_quantizer():
    x = torch.randn(19, 128)
    packed, scales = quant.quantize_fp4(x)
    assert torch.equal(fp4_roundtrip(x), quant.dequantize_fp4(packed, scales))


def test_a_short_last_block_and_zero_rows():
    x = torch.randn(5, 80)
    x[2] = 0
    got = fp8_roundtrip(x)
    assert torch.equal(got[:, :64], fp8_roundtrip(x[:, :64]))
    assert torch.equal(got[:, 64:], fp8_roundtrip(x[:, 64:]))  # the last 16 dims: a block of their own
    assert torch.equal(got[2], torch.zeros(80))


def test_round_kv_keeps_rope_dims_in_bf16_and_is_exact_in_bf16_storage():
    p = KVPrecision("fp8", rope_dims=64)
    rows = torch.randn(9, 512) * 3
    out = p.round_kv(rows)
    assert torch.equal(out[:, 448:], rows[:, 448:].bfloat16().float())
    assert torch.equal(out[:, :448], fp8_roundtrip(rows[:, :448]))
    assert torch.equal(out.bfloat16().float(), out)  # a bf16 cache holds the rounded values without loss
    assert torch.equal(p.round_kv(out), out)
    assert KVPrecision("auto").round_kv(rows) is rows
    assert torch.equal(KVPrecision("bf16").round_kv(rows), rows.bfloat16().float())


def test_index_keys_turned_by_hadamard_keep_scores_then_round_to_fp4():
    p = KVPrecision("fp8", rope_dims=64)
    q, k = torch.randn(6, 64, 128), torch.randn(11, 128)
    exact = torch.einsum("thd,nd->thn", q, k)
    turned = torch.einsum("thd,nd->thn", p.rotate_index_queries(q), hadamard(k))
    assert torch.allclose(turned, exact, atol=1e-4)
    stored = p.round_index_keys(k)
    assert torch.equal(stored, fp4_roundtrip(hadamard(k)))
    assert torch.equal(hadamard(hadamard(k)), hadamard(hadamard(k)))  # deterministic
    assert torch.allclose(hadamard(hadamard(k)), k, atol=1e-5)  # its own inverse
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.randn(3, 96))


def test_stored_bytes_at_v4_flash_shapes():
    p = KVPrecision("fp8", rope_dims=64)
    assert p.kv_row_bytes(512, 2) == 592  # 448 e4m3 + 64 bf16 + 7 scales, padded to 16 (FlashMLA's alignment)
    assert p.index_key_bytes(128, 2) == 68  # 64 packed e2m1 + 4 scales
    window, d = 128, 512
    csa = LayerStateSpec(window, d, StreamSpec(4, d, True), StreamSpec(4, 128, True))
    hca = LayerStateSpec(window, d, StreamSpec(128, d, False))
    sliding = LayerStateSpec(window, d)
    flash = [sliding] * 2 + [csa, hca] * 20 + [csa]  # 43 layers: 21 CSA, 20 HCA
    P = 256
    bf16 = specs_bytes_per_page(flash, P, torch.bfloat16)
    fp8 = specs_bytes_per_page(flash, P, torch.bfloat16, p)
    # the rows that grow with the context: spec 4.3's 6,880 B/token in bf16, about 3.5 KB at reference precision
    growth = lambda precision: (specs_bytes_per_page(flash, 2 * P, torch.bfloat16, precision)  # noqa: E731
                                - specs_bytes_per_page(flash, P, torch.bfloat16, precision)) / P
    assert growth(None) == 6880
    assert growth(p) == 21 * (592 + 68) / 4 + 20 * 592 / 128  # 3,557.5 B/token: 0.52 of bf16
    assert 0.5 < fp8 / bf16 < 0.6  # with the page's window snapshot and the fp32 CSA overlap state


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVPrecision("fp16")


def test_cli_flag_reaches_the_engine_options():
    from deepserve.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "some-model", "--kv-cache-dtype", "fp8"])
    assert engine_options(args)["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "some-model", "--kv-cache-dtype", "int4"])


# -- the engine on the tiny model --------------------------------------------------------------------------------
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(150)]


def _run(llm, prompt=PROMPT, max_tokens=12, prompt_logprobs=2):
    """Greedy; prompt logprobs (None: none, so that the prompt may come from the prefix cache)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, prompt_logprobs=prompt_logprobs)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def _prompt_logprobs(out, prompt=PROMPT):
    return torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])


@pytest.fixture(scope="module")
def fp8_llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", accelerator="cpu", kv_cache_dtype="fp8", block_size=128)


def test_fp8_engine_against_the_model_dtype():
    runs = {kv: LLM(EMBEDDED, dtype="float32", accelerator="cpu", block_size=128, kv_cache_dtype=kv)
            for kv in ("auto", "fp8", "bf16")}
    prompt = runs["auto"].tokenizer.encode(TEXT)
    assert len(prompt) > 100  # CSA rows past the indexer's top-k: its FP4 keys choose
    exact, fp8, bf16 = (_run(runs[kv], prompt, max_tokens=1) for kv in ("auto", "fp8", "bf16"))
    diff = (_prompt_logprobs(exact, prompt) - _prompt_logprobs(fp8, prompt)).abs()
    assert diff.max() < LOGPROB_BOUND and diff.mean() < LOGPROB_MEAN_BOUND
    # the rounding is on, and coarser than bf16's (3 mantissa bits against 8: measured 8x on average)
    bf16_diff = (_prompt_logprobs(exact, prompt) - _prompt_logprobs(bf16, prompt)).abs()
    assert 0 < bf16_diff.mean() < diff.mean() / 3
    # the greedy choice at every prompt position (teacher-forced: one near-tie does not carry on) agrees wherever
    # the fp32 run's top-2 margin is at least GREEDY_MARGIN
    checked = 0
    for ref, got in zip(exact.prompt_logprobs[1:], fp8.prompt_logprobs[1:]):
        top = sorted(ref.items(), key=lambda kv: -kv[1].logprob)
        if top[0][1].logprob - top[1][1].logprob >= GREEDY_MARGIN:
            assert max(got.items(), key=lambda kv: kv[1].logprob)[0] == top[0][0]
            checked += 1
    assert checked >= 100


def test_fp8_engine_is_exact_against_itself_across_chunking_and_prefix_hits(tiny_dir, fp8_llm):
    def steps(out):
        return out.outputs[0].token_ids, [{t: e.logprob for t, e in s.items()} for s in out.outputs[0].logprobs]

    whole = _run(fp8_llm)
    first, again = _run(fp8_llm, prompt_logprobs=None), _run(fp8_llm, prompt_logprobs=None)
    assert again.num_cached_tokens == 128  # the prompt's first page: rows rounded once, read back as they were
    chunked = _run(LLM(tiny_dir, dtype="float32", accelerator="cpu", kv_cache_dtype="fp8", block_size=128,
                       max_num_batched_tokens=7, max_num_seqs=2, enable_prefix_caching=False))
    for out in (first, again, chunked):
        assert steps(out) == steps(whole)
    assert torch.equal(_prompt_logprobs(chunked), _prompt_logprobs(whole))


def test_fp8_engine_names_its_precision_and_stored_bytes(fp8_llm):
    from deepserve.build import kv_namespace
    from deepserve.model.kv_cache import bytes_per_page

    model, P = fp8_llm.model, 128
    assert model.kv_precision.kv_cache_dtype == "fp8"
    stored = bytes_per_page(model, P, torch.float32, precision=model.kv_precision)
    # the pools hold the stored form, so the CPU default budget buys pages at its price (tests/test_kv_fp8_packed.py)
    assert fp8_llm.cache.num_pages * stored <= 2**29 < (fp8_llm.cache.num_pages + 1) * stored
    bf16 = bytes_per_page(model, P, torch.bfloat16)
    # the tiny model's rows are half RoPE dims (kept bf16): 16 e4m3 + 32 + 1 scale byte, padded to 16 bytes (the
    # alignment FlashMLA reads rows at), is 64, bf16's own row; its 16-wide indexer keys take 8 + 1 bytes against
    # 32, so only they shrink here, where V4-Flash's shapes give 0.52 of the per-token growth
    # (test_stored_bytes_at_v4_flash_shapes)
    precision = model.kv_precision
    assert (precision.kv_row_bytes(32, 4), precision.index_key_bytes(16, 4)) == (64, 9)
    assert stored < bf16
    namespace = kv_namespace(fp8_llm.config, model, P, {"layers.csa": 1})
    assert namespace.split("/")[3] == "fp8_e4m3"


def test_fp8_static_decode_equals_the_paged_decode(tiny_dir, fp8_llm):
    """The fixed-shape decode step CUDA graphs capture (run eagerly here) in fp8 mode: it skips the fused
    compressor kernel and rounds its rows as the paged path does, so the outputs are the same bits."""
    from deepserve.model.cuda_graphs import DecodeGraphs

    paged = _run(fp8_llm, prompt_logprobs=None)
    llm = LLM(tiny_dir, dtype="float32", accelerator="cpu", kv_cache_dtype="fp8", block_size=128,
              enable_prefix_caching=False)
    llm.runner.graphs = DecodeGraphs(llm.model, llm.cache, 4, 4, capture=False)
    calls = []
    forward = llm.runner.graphs.forward
    llm.runner.graphs.forward = lambda b, s: calls.append(len(s)) or forward(b, s)
    static = _run(llm, prompt_logprobs=None)
    assert len(calls) >= 10  # the decode steps went through it
    assert static.outputs[0].token_ids == paged.outputs[0].token_ids
    assert [{t: e.logprob for t, e in s.items()} for s in static.outputs[0].logprobs] == \
        [{t: e.logprob for t, e in s.items()} for s in paged.outputs[0].logprobs]


def test_fp8_with_mtp_speculation_keeps_the_greedy_tokens():
    """The MTP drafter's window rows are rounded too (`use_kv_cache_dtype` reaches every attention layer), and a
    verify pass rounds each row as a decode step would: speculative greedy tokens are the plain fp8 ones."""
    def make(**kw):
        return LLM(EMBEDDED, dtype="float32", accelerator="cpu", block_size=128, kv_cache_dtype="fp8",
                   load_plugins=False, **kw)

    spec = make(speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    drafter = [m for m in spec.model.mtp.modules() if hasattr(type(m), "kv_precision")]
    assert drafter and all(m.kv_precision.fp8 for m in drafter)
    prompt = spec.tokenizer.encode(TEXT)[:120]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    want = make().generate([prompt], params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_accepted_tokens > 0
