"""The FP8 KV cache's packed storage (`kv_cache_dtype="fp8"`, docs/quantization.md): the pools hold e4m3 codes,
bf16 RoPE dims and scale bytes (FP4 nibbles and scale bytes for the indexer keys), so a page costs what
`bytes_per_page(precision=...)` says and a budget buys pages at that price; every read decodes to exactly the values
the emulated cache held (the rounded rows at the model dtype), so the engine's outputs are the same bits."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.model import quant
from deepserve.model.kv_cache import _LayerPools, bytes_per_page, page_pool_bytes, read_pages, specs_bytes_per_page
from deepserve.model.kv_precision import KVPrecision, PlainRows, fp4_roundtrip, hadamard
from deepserve.model.state import LayerStateSpec, StreamSpec

P = 128
BUDGET = 2**24  # 16 MiB of pages: room for the prompts below, little memory per engine
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (torch.equal calls -0.0 and 0.0 equal)."""
    return a.dtype == b.dtype and torch.equal(a.view(INT[a.dtype]), b.view(INT[b.dtype]))


# -- the stored rows ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kv_row_is_stored_as_e4m3_codes_bf16_rope_and_scale_bytes(dtype):
    p = KVPrecision("fp8", rope_dims=64)
    rows = (torch.randn(6, 5, 512) * torch.logspace(-3, 3, 512)).to(dtype)
    rows[0, 0] = 0  # an all-zero row
    rows[1, 1, :7] = -1e-30  # negative values that round to -0.0 in their block
    codec = p.kv_codec(512, dtype)
    stored = codec.encode(rows)
    assert stored.dtype == torch.uint8 and stored.shape == (6, 5, 592) == (6, 5, p.kv_row_bytes(512, 2))
    # DeepSeek's weight quantizer with 1 x 64 blocks: the same codes and UE8M0 scale bytes
    codes, scales = quant.quantize_fp8(rows[..., :448].float(), block=(1, 64), scale_as_uint8=True)
    assert torch.equal(stored[..., :448], codes.view(torch.uint8))
    assert torch.equal(stored[..., 448:576], rows[..., 448:].bfloat16().contiguous().view(torch.uint8))
    assert torch.equal(stored[..., 576:583], scales) and not stored[..., 583:].any()
    # a read gives the values the emulated cache held, bit for bit, -0.0 included; a rounded row is stored as is
    assert same_bits(codec.decode(stored), p.round_kv(rows))
    assert same_bits(codec.decode(codec.encode(p.round_kv(rows))), p.round_kv(rows))
    assert torch.signbit(codec.decode(stored)[1, 1, :7]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_indexer_key_is_stored_as_fp4_nibbles_and_scale_bytes(dtype):
    p = KVPrecision("fp8", rope_dims=64)
    keys = (torch.randn(9, 128) * 4).to(dtype)
    keys[2, :40] = 0
    codec = p.index_key_codec(128, dtype)
    stored = codec.encode(hadamard(keys))
    assert stored.dtype == torch.uint8 and stored.shape == (9, 68) == (9, p.index_key_bytes(128, 2))
    # the expert quantizer's decoder (low nibble first, codes 8-15 negative) reads the same values
    _, scales = quant.quantize_fp4(hadamard(keys), scale_as_uint8=True)
    assert torch.equal(stored[:, 64:], scales)
    assert torch.equal(quant.dequantize_fp4(stored[:, :64].view(torch.int8), stored[:, 64:]),
                       fp4_roundtrip(hadamard(keys)))
    rounded = p.round_index_keys(keys)  # what the emulated cache held: turned, rounded, at the model dtype
    assert same_bits(codec.decode(stored), rounded)
    assert same_bits(codec.decode(codec.encode(rounded)), rounded)


def test_short_blocks_and_odd_widths_round_trip():
    p = KVPrecision("fp8", rope_dims=16)
    rows = torch.randn(4, 32) * 10  # the tiny model's rows: 16 e4m3 dims (one short block) and 16 RoPE dims
    codec = p.kv_codec(32, torch.float32)
    assert codec.encode(rows).shape[-1] == 64 and same_bits(codec.decode(codec.encode(rows)), p.round_kv(rows))
    keys = torch.randn(3, 45)
    codec = p.index_key_codec(45, torch.float32)
    assert codec.encode(keys).shape[-1] == 23 + 2
    assert same_bits(codec.decode(codec.encode(keys)), fp4_roundtrip(keys))


# -- the pools -----------------------------------------------------------------------------------------------------
def test_pools_at_v4_flash_shapes_allocate_what_bytes_per_page_counts():
    window, d, page = 128, 512, 256
    csa = LayerStateSpec(window, d, StreamSpec(4, d, True), StreamSpec(4, 128, True))
    hca = LayerStateSpec(window, d, StreamSpec(128, d, False))
    specs = [LayerStateSpec(window, d), csa, hca]
    for precision in (KVPrecision("auto"), KVPrecision("bf16", 64), KVPrecision("fp8", 64)):
        layers = [_LayerPools(s, 2, page, 1, torch.bfloat16, "cpu", 0, precision) for s in specs]
        allocated = sum(page_pool_bytes(SimpleNamespace(pools={"layers": layers})).values())
        assert allocated == specs_bytes_per_page(specs, page, torch.bfloat16, precision)
    fp8 = [_LayerPools(s, 2, page, 1, torch.bfloat16, "cpu", 0, KVPrecision("fp8", 64)) for s in specs]
    assert all(layer.storage.dtype == torch.uint8 and layer.storage.shape[1] == 592 for layer in fp8)
    assert fp8[1].indexer.rows.shape == (2, 64, 68) and fp8[1].compressor.rows.shape == (2, 64, 592)
    assert fp8[1].snap_window.shape == (2, 128, 592)
    # per token of context (the rows that grow): 592 / 4 + 68 / 4 for CSA, 592 / 128 for HCA, against bf16's
    growth = {kv: specs_bytes_per_page([csa, hca], 2 * page, torch.bfloat16, KVPrecision(kv, 64))
              - specs_bytes_per_page([csa, hca], page, torch.bfloat16, KVPrecision(kv, 64)) for kv in ("bf16", "fp8")}
    assert growth == {"bf16": page * (1024 / 4 + 256 / 4 + 1024 / 128), "fp8": page * (660 / 4 + 592 / 128)}


def tiny_llm(tiny_dir, kv_cache_dtype="fp8", **kw):
    kw.setdefault("kv_cache_bytes", BUDGET)
    return LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, kv_cache_dtype=kv_cache_dtype, **kw)


@pytest.fixture(scope="module")
def packed(tiny_dir):
    return tiny_llm(tiny_dir)


def test_the_engine_buys_pages_at_the_stored_price(tiny_dir, packed):
    model = packed.model
    stored = bytes_per_page(model, P, torch.float32, precision=model.kv_precision)
    assert sum(page_pool_bytes(packed.cache).values()) == stored
    assert packed.cache.num_pages == BUDGET // stored
    assert all(layer.storage.dtype == torch.uint8 for layer in packed.cache.layers)
    plain = tiny_llm(tiny_dir, "auto")
    assert plain.cache.num_pages == BUDGET // bytes_per_page(plain.model, P, torch.float32)
    # the tiny model's fp32 rows (32 dims, half RoPE) take 128 bytes, stored ones 64 (16-byte rows): 1.9x the pages
    assert packed.cache.num_pages > 1.8 * plain.cache.num_pages, (packed.cache.num_pages, plain.cache.num_pages)


# -- the engine against the emulated pools -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated(tiny_dir):
    """The fp8 engine as it was before the pools were packed: the same rounding in the model, the pools at the
    model dtype holding the rounded values (every codec plain)."""
    with pytest.MonkeyPatch.context() as mp:
        plain = lambda self, width, dtype: PlainRows(width, dtype, dtype)  # noqa: E731
        mp.setattr(KVPrecision, "kv_codec", plain)
        mp.setattr(KVPrecision, "index_key_codec", plain)
        llm = tiny_llm(tiny_dir)
    assert all(layer.storage.dtype == torch.float32 for layer in llm.cache.layers)
    return llm


def prompts(seed: int, n: int = 2, length: int = 2 * P + 40) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 512) for _ in range(P + 10)]  # a shared first page: the second prompt hits it
    return [shared + [rng.randrange(2, 512) for _ in range(length - len(shared))] for _ in range(n)]


def outputs(llm, items, prompt_logprobs=2):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=prompt_logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in items], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: e.logprob for t, e in s.items()} for s in o.outputs[0].logprobs],
             [None if s is None else {t: e.logprob for t, e in s.items()} for s in (o.prompt_logprobs or [])],
             o.num_cached_tokens) for o in outs]


def test_packed_pools_give_the_emulated_engines_bits(packed, emulated):
    items = prompts(1)
    # prompt logprobs for the first (computed whole); the second hits its first page (no prompt logprobs then)
    want = outputs(emulated, items[:1]) + outputs(emulated, items[1:], prompt_logprobs=None)
    got = outputs(packed, items[:1]) + outputs(packed, items[1:], prompt_logprobs=None)
    assert got == want
    assert got[1][3] == P  # the prefix hit: its rows and window snapshot read back from the packed page
    again = outputs(packed, items, prompt_logprobs=None)  # whole prompts from the cache but their last tokens
    assert [o[:2] for o in again] == [o[:2] for o in want] and [o[3] for o in again] == [2 * P, 2 * P]


def test_chunked_prefill_and_the_contiguous_layout_over_packed_pages(tiny_dir, emulated, monkeypatch):
    from deepserve.model import layouts

    items = prompts(2, n=1)
    want = outputs(emulated, items)
    chunked = tiny_llm(tiny_dir, max_num_batched_tokens=7, max_num_seqs=2, enable_prefix_caching=False)
    assert outputs(chunked, items) == want
    monkeypatch.setattr(layouts, "PAGED", False)  # every step through the per-sequence layout's reads and writes
    contiguous = tiny_llm(tiny_dir, max_num_batched_tokens=37, enable_prefix_caching=False)
    assert outputs(contiguous, items) == want


def test_the_fixed_shape_decode_step_reads_packed_pages(tiny_dir, emulated):
    from deepserve.model.cuda_graphs import DecodeGraphs

    items = prompts(3, n=2)
    want = outputs(emulated, items, prompt_logprobs=None)
    llm = tiny_llm(tiny_dir, enable_prefix_caching=False)
    llm.runner.graphs = DecodeGraphs(llm.model, llm.cache, 4, 8, capture=False)
    calls = []
    forward = llm.runner.graphs.forward
    llm.runner.graphs.forward = lambda b, s: calls.append(len(s)) or forward(b, s)
    # the fused ops that write the storage in place (the NVIDIA backend's kernels) are never handed packed rows
    backend, handed = llm.model.backend, []
    for op in ("decode_key_rows", "paged_window_write"):
        fused = getattr(backend, op)
        setattr(backend, op, lambda storage, *a, fused=fused: handed.append(storage.dtype) or fused(storage, *a))
    assert outputs(llm, items, prompt_logprobs=None) == want
    assert len(calls) >= 10 and max(calls) == 2  # the decode steps of both sequences went through it
    assert torch.uint8 not in handed


def test_pages_evicted_to_host_memory_come_back_as_their_packed_bytes(tiny_dir, packed):
    items = prompts(4, n=1)
    want = outputs(packed, items, prompt_logprobs=None)
    page = bytes_per_page(packed.model, P, torch.float32, precision=packed.model.kv_precision)
    llm = tiny_llm(tiny_dir, kv_cache_bytes=4 * page, host_cache_bytes=2**24)
    assert outputs(llm, items, prompt_logprobs=None) == want
    blocks = read_pages(llm.cache, [0])
    assert {name: len(b) for name, b in blocks[0].items()} == page_pool_bytes(llm.cache)  # the stored form
    outputs(llm, prompts(5, n=2), prompt_logprobs=None)  # other prompts take every GPU page
    out = outputs(llm, items, prompt_logprobs=None)
    assert [o[:2] for o in out] == [o[:2] for o in want] and out[0][3] == 2 * P
    assert llm.engine.snapshot().kv_tiers["host"].num_hit_tokens >= P


def test_a_step_decodes_only_the_rows_it_reads(packed):
    seen = []
    backend = packed.model.backend
    attend = backend.sparse_attention_rope

    def spy(q, kv, indices, *args):
        seen.append((kv.shape[0], kv.dtype))
        return attend(q, kv, indices, *args)

    backend.sparse_attention_rope = spy
    try:
        outputs(packed, prompts(6, n=1), prompt_logprobs=None)
    finally:
        del backend.sparse_attention_rope
    storage_rows = min(layer.storage.shape[0] for layer in packed.cache.layers)
    assert seen and all(dtype == torch.float32 for _, dtype in seen)
    assert max(rows for rows, _ in seen) < storage_rows / 10  # decoded keys, not the pools


def test_an_swa_replay_writes_the_emulated_snapshot_into_a_packed_page(packed, emulated):
    from deepserve.core.kv.prefix_hash import block_hashes
    from deepserve.model.swa_replay import exact_length, replay_snapshot

    prompt = prompts(7, n=1)[0]
    snapshots = []
    for llm in (emulated, packed):
        outputs(llm, [prompt], prompt_logprobs=None)
        cache = llm.cache
        table = [llm.engine.scheduler.kv.pool.get_cached(h) for h in block_hashes(prompt[: 2 * P], P, None)]
        assert replay_snapshot(cache, table, 2 * P, prompt, exact_length(cache)) == exact_length(cache)
        snapshots.append([layer.codec.decode(layer.snap_window[table[-1]]) for layer in cache.layers])
    assert all(same_bits(a, b) for a, b in zip(*snapshots))


def test_an_swa_host_slot_restores_a_packed_sequence(tiny_dir, packed):
    rng = random.Random(8)
    first, more = [rng.randrange(2, 512) for _ in range(150)], [rng.randrange(2, 512) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = tiny_llm(tiny_dir, swa_host_slots=2)
    second = first + llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0].outputs[0].token_ids + more
    warm = outputs(llm, [second], prompt_logprobs=None)[0]
    cold = outputs(tiny_llm(tiny_dir), [second], prompt_logprobs=None)[0]
    assert llm.engine.swa_slots.stats.num_restored == 1 and warm[3] > P and warm[3] % P  # pages, then the slot
    assert warm[0] == cold[0]
    # the MXFP8 slot is lossy (docs/cache.md): its effect on the next tokens' logprobs, as for the model dtype
    assert max(abs(a[t] - b[t]) for t, a, b in zip(warm[0], warm[1], cold[1])) < 0.1


def test_speculative_rollback_and_the_draft_chain_over_packed_rings(tmp_path):
    """MTP speculation in fp8 mode: verify passes roll back packed window rings (stored bytes saved and put back),
    and the drafter's chain runs as the static forwards its CUDA graphs capture (eagerly here): greedy tokens equal
    plain greedy decoding's."""
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path / "m", seed=2)
    items = [[5, 6, 7, 8], list(range(10, 110)), [9] * 33]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 4}
    outs, accepted, calls = {}, {}, []
    for name in ("plain", "eager", "chain"):
        llm = LLM(path, dtype="float32", max_num_seqs=4, kv_cache_dtype="fp8", kv_cache_bytes=BUDGET,
                  speculative_config=None if name == "plain" else spec)
        assert all(layer.storage.dtype == torch.uint8 for pools in llm.cache.pools.values() for layer in pools)
        if name == "chain":
            assert llm.proposer.capture_graphs(llm.cache, max_batch=4, capture=False) == 3
            run = llm.proposer.chain_graphs.run
            llm.proposer.chain_graphs.run = lambda *a: calls.append(1) or run(*a)
        done = llm.generate([{"prompt_token_ids": p} for p in items], params, use_tqdm=False)
        outs[name], accepted[name] = [o.outputs[0].token_ids for o in done], [o.num_accepted_tokens for o in done]
    assert len(calls) > 5
    assert outs["chain"] == outs["eager"] == outs["plain"]
    assert accepted["chain"] == accepted["eager"] and sum(accepted["chain"]) > 0  # the same drafts

# -- on an NVIDIA GPU (marked gpu: skipped without one) -----------------------------------------------------------
@pytest.mark.gpu
def test_the_codecs_on_the_device_store_and_read_the_cpus_bytes():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(2048, 512, generator=g) * torch.logspace(-4, 2, 512)
    keys = hadamard(torch.randn(2048, 128, generator=g))
    p = KVPrecision("fp8", rope_dims=64)
    for dtype in (torch.float32, torch.bfloat16):
        for codec, x in ((p.kv_codec(512, dtype), rows.to(dtype)), (p.index_key_codec(128, dtype), keys.to(dtype))):
            stored = codec.encode(x)
            assert torch.equal(codec.encode(x.cuda()).cpu(), stored)
            assert same_bits(codec.decode(stored.cuda()).cpu(), codec.decode(stored))


@pytest.mark.gpu
def test_packed_pools_on_nvidia_with_cuda_graphs_against_the_emulated_pools(tiny_dir):
    """The NVIDIA backend's kernels read decoded rows in fp8 mode (its in-place writers are not used); the emulated
    pools let them read and write the storage in place. The same values either way: the same greedy tokens, and
    logprobs within the kernels' float noise (fp32)."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        plain = lambda self, width, dtype: PlainRows(width, dtype, dtype)  # noqa: E731
        mp.setattr(KVPrecision, "kv_codec", plain)
        mp.setattr(KVPrecision, "index_key_codec", plain)
        emulated = LLM(tiny_dir, dtype="float32", accelerator="nvidia", block_size=P, kv_cache_dtype="fp8")
    packed = LLM(tiny_dir, dtype="float32", accelerator="nvidia", block_size=P, kv_cache_dtype="fp8")
    assert packed.graphs is not None and packed.cache.layers[0].storage.dtype == torch.uint8
    items = prompts(9)
    want, got = outputs(emulated, items), outputs(packed, items)
    assert [o[0] for o in got] == [o[0] for o in want]
    for a, b in zip(got, want):
        assert max(abs(x[t] - y[t]) for t, x, y in zip(a[0], a[1], b[1])) < 1e-3  # each chosen token's
