"""The NVIDIA backend's kernels that read the FP8 KV cache's packed rows in place (`triton_ops/packed_kv.py`) against
decoding the rows (`RowCodec.decode`) and the reference ops, on the CPU under Triton's interpreter at small shapes;
and the backend ops over packed pools (`PackedKVOps`) against their decoding fallback, alone and in the engine.
Skipped where triton is not installed and where a GPU is: tests/gpu/test_kv_fp8_kernels.py runs the same `check_*`
functions there at V4-Flash shapes.

The interpreter must be chosen before triton is first imported, so the checks run in one child process started
with TRITON_INTERPRET=1 (`python test_kv_fp8_triton.py CHECKPOINT_DIR`), and each test reads its case's result.
Outputs are NaN-poisoned first (an element not written shows). Rows are encoded by the codecs themselves, so the
kernels' decoding is checked against theirs: a code times a power of two is exact in bf16, and both sides
multiply the same key values."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
from types import SimpleNamespace

import pytest
import torch

from interpreted import child_main, run_child

from deepserve.backends.reference import ReferenceBackend
from deepserve.model.kv_precision import KVPrecision, hadamard

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.importorskip("triton")  # only where it is installed; the child process imports it itself


# -- the checks (shared with tests/gpu/test_kv_fp8_kernels.py) -----------------------------------------------------

def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output holds NaN (an element was not written)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def packed_kv_rows(N: int, d: int, rope: int, dtype, g: torch.Generator, device):
    """(codec, stored rows [N, stored bytes] on `device`): rows of widely ranging magnitude per 64-dim block, one
    all-zero row and one with tiny negative values (codes of -0.0), as the cache keeps them (`FP8Rows`)."""
    rows = torch.randn(N, d, generator=g) * torch.logspace(-3, 2, d)[torch.randperm(d, generator=g)]
    rows[0] = 0
    rows[1, :8] = -1e-30
    codec = KVPrecision("fp8", rope_dims=rope).kv_codec(d, dtype)
    return codec, codec.encode(rows.to(dtype)).to(device)


def attention_case(T, H, d, rope, N, K, dtype, g, device):
    """q, indices (about a quarter -1; with several queries, query 0 sees no key at all, so only the sink: a lone
    query sees keys, else the reference is zero and the relative error 0 / 0), sinks, positions, inv_freq."""
    q = torch.randn(T, H, d, generator=g).to(device, dtype)
    indices = torch.randint(0, N, (T, K), generator=g)
    indices[torch.rand(T, K, generator=g) < 0.25] = -1
    if T > 1:
        indices[0] = -1
    sinks = torch.randn(H, generator=g).to(device)
    positions = torch.randint(0, 5000, (T,), generator=g).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rope, 2).float() / rope)).to(device)
    return q, indices.to(device), sinks, positions, inv_freq


def check_sparse_mqa_packed(k, device, T, H, d, rope, N, K, dtype=torch.float32, splits=None, seed=0) -> None:
    """`sparse_mqa_packed` over packed rows against the reference `sparse_attention_rope` (fp32) over the decoded
    rows, within the dtype's rounding; with `splits`, the index list split into that many parts (merged)."""
    g = torch.Generator().manual_seed(seed)
    codec, stored = packed_kv_rows(N, d, rope, dtype, g, device)
    q, indices, sinks, positions, inv_freq = attention_case(T, H, d, rope, N, K, dtype, g, device)
    scale = d ** -0.5
    out = torch.full((T, H, d), float("nan"), dtype=dtype, device=device)
    y = k.packed_kv.sparse_mqa_packed(q, stored, codec.nope, indices, sinks, scale, out=out,
                                      rope=(positions, inv_freq), tiles={"splits": splits} if splits else None)
    assert y.data_ptr() == out.data_ptr()
    ref = ReferenceBackend(device, exact=False).sparse_attention_rope(
        q.float(), codec.decode(stored).float(), indices, sinks, scale, positions, inv_freq)
    if T > 1:
        assert torch.equal(y[0].float(), torch.zeros_like(y[0].float())), "a query with no keys attends to the sink only"
    assert rel_err(y, ref) < tolerance(dtype), (T, H, d, K, dtype, splits)


def packed_index_pages(num_pages, rpp, Di, dtype, g, device, ties: bool = False):
    """(codec, pages [num_pages, rpp, Di / 2 + Di / 32] uint8): Hadamard-turned keys as the cache keeps them
    (`FP4Keys`), one page with zeros and -0.0 codes. `ties`: each odd row repeats the row before it, so that
    scores tie exactly."""
    keys = hadamard(torch.randn(num_pages, rpp, Di, generator=g) * 3)
    if ties:
        keys[:, 1::2] = keys[:, 0::2]
    keys[0, 0] = 0
    keys[0, 1, :5] = -1e-30
    codec = KVPrecision("fp8", rope_dims=0).index_key_codec(Di, dtype)
    return codec, codec.encode(keys.to(dtype)).to(device)


def index_case(T, B, Hi, Di, P, num_pages, rpp, dtype, g, device, query_rows: bool, exact: bool = False):
    """q, weights, tables [B, P] (distinct pages a row), query_rows [T] (or None: T == B), key_count [T] (zero
    to the tables' full width). `exact`: small integers as queries and quarters as weights, so that every score
    of FP4 keys is exact in fp32 whatever the order of its sums (equal keys score exactly equal)."""
    if exact:
        q = torch.randint(-3, 4, (T, Hi, Di), generator=g).to(device, dtype)
        weights = (torch.randint(1, 5, (T, Hi), generator=g) / 4).to(device)
    else:
        q = torch.randn(T, Hi, Di, generator=g).to(device, dtype)
        weights = torch.rand(T, Hi, generator=g).to(device)
    tables = torch.stack([torch.randperm(num_pages, generator=g)[:P] for _ in range(B)]).to(device)
    rows = torch.randint(0, B, (T,), generator=g).to(device) if query_rows else None
    key_count = torch.randint(0, P * rpp + 1, (T,), generator=g)
    key_count[0], key_count[-1] = 0, P * rpp
    return q, weights, tables, rows, key_count.to(device)


def reference_index_scores(q, weights, decoded_pages, tables, rows, key_count) -> torch.Tensor:
    """sum_h weights[t, h] * relu(q[t, h] . key) over each query's table row's keys, fp32 [T, P * rpp], -inf past
    its count."""
    table = tables if rows is None else tables[rows]
    keys = decoded_pages.float()[table].flatten(1, 2)  # [T, P * rpp, Di]
    scores = (torch.relu(torch.einsum("thd,tkd->thk", q.float(), keys)) * weights[:, :, None]).sum(1)
    visible = torch.arange(keys.shape[1], device=q.device)[None, :] < key_count[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def check_packed_index_scores(k, device, T, B, Hi, Di, P, num_pages, rpp, dtype=torch.float32, query_rows=True,
                              seed=0) -> None:
    """`packed_index_scores` over FP4 pages through block tables against the scores of the decoded keys: -inf
    exactly where the reference has it, the rest within the dtype's rounding (q is rounded to it too)."""
    g = torch.Generator().manual_seed(seed)
    codec, pages = packed_index_pages(num_pages, rpp, Di, dtype, g, device)
    q, weights, tables, rows, key_count = index_case(T, B, Hi, Di, P, num_pages, rpp, dtype, g, device, query_rows)
    out = torch.full((T, P * rpp), float("nan"), dtype=torch.float32, device=device)
    scores = k.packed_kv.packed_index_scores(q, weights, pages, tables, key_count, dtype, rows, out=out)
    assert scores.data_ptr() == out.data_ptr()
    ref = reference_index_scores(q, weights, codec.decode(pages), tables, rows, key_count)
    assert not torch.isnan(scores).any(), "a score was not written"
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert rel_err(scores[finite], ref[finite]) < tolerance(dtype), (T, B, Di, P, rpp, dtype)


def edge_rows(n: int, width: int, g: torch.Generator) -> torch.Tensor:
    """fp32 rows of widely ranging magnitude (2^-140 .. 2^60 between blocks and within them), with the values where
    the encoders round: a zero row and a -0.0 row, tiny negatives that round to -0.0, subnormal fp32 maxima, values
    halfway between two e4m3 / e2m1 codes (ties go to even / down), a block maximum exactly at 448 * 2^k or 6 * 2^k
    and one just above it, e4m3 subnormals."""
    rows = torch.randn(n, width, generator=g) * torch.exp2(torch.randint(-40, 40, (n, width), generator=g).float())
    rows[:, : width // 2] *= torch.exp2(torch.randint(-100, 20, (n, 1), generator=g).float())
    rows[0] = 0
    rows[1] = -0.0
    rows[2, :8] = -1e-30
    rows[3] = torch.randn(width, generator=g) * 1e-39  # subnormal fp32
    rows[4, ::2] = 1.0625  # halfway between e4m3 1.0 and 1.125 (to even: 1.0) ...
    rows[4, 1::2] = 1.1875  # ... and 1.125 / 1.25 (to even: 1.25), with a block maximum of 448 * 2^-8 below
    rows[4, 0] = 1.75
    rows[5, :] = 448.0 * 2.0 ** 5
    rows[5, 1] = torch.nextafter(torch.tensor(448.0 * 2.0 ** 5), torch.tensor(1e9))  # just above: one power more
    rows[6, :] = 6.0 * 2.0 ** -3
    rows[6, 3] = 1.25 * 2.0 ** -3  # an e2m1 midpoint (to the smaller code)
    rows[7, :] = 2.0 ** -12  # e4m3 subnormals after the block's scale (the maximum set below)
    rows[7, 0] = 448.0
    rows[7, 5] = 3 * 2.0 ** -10  # halfway between subnormal codes 2^-9 and 2^-8 (to even: 2^-8)
    return rows


def check_store_rows(k, device, kind: str, width: int, rope: int = 0, dtype=torch.float32, n: int = 24,
                     seed: int = 0) -> None:
    """`store_fp8_rows` / `store_fp4_keys` (kind "fp8" / "fp4") against the codec's `encode` bit for bit, into a
    storage of garbage bytes at scattered rows (and at a run of rows from a base): every byte of a written row is
    the codec's, every other row keeps its garbage."""
    g = torch.Generator().manual_seed(seed)
    rows = edge_rows(n, width, g).to(dtype)
    precision = KVPrecision("fp8", rope_dims=rope)
    codec = precision.kv_codec(width, dtype) if kind == "fp8" else precision.index_key_codec(width, dtype)
    want = codec.encode(rows)
    N = 3 * n
    for dest in (torch.randperm(N, generator=g)[:n], None):
        garbage = torch.randint(0, 256, (N, codec.stored_width), generator=g, dtype=torch.uint8)
        storage = garbage.clone().to(device)
        x = rows.to(device)
        if kind == "fp8":
            k.packed_writes.store_fp8_rows(x, storage, codec.nope, None if dest is None else dest.to(device), base=n)
        else:
            k.packed_writes.store_fp4_keys(x, storage, None if dest is None else dest.to(device), base=n)
        written = torch.arange(n, 2 * n) if dest is None else dest
        storage = storage.cpu()
        bad = (storage[written] != want).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"rows {bad} differ from the codec's bytes (first: {storage[written][bad[0]].tolist()} " \
                        f"against {want[bad[0]].tolist()})"
        others = torch.ones(N, dtype=torch.bool)
        others[written] = False
        assert torch.equal(storage[others], garbage[others]), "a row not named was written"


@contextlib.contextmanager
def kernel_calls():
    """Counts the calls of the packed-row kernels' entry points while in the block: {"attention", "indexer",
    "writes"} (the reads, and the FP8 row and FP4 key stores together)."""
    from deepserve.backends.nvidia.triton_ops import packed_kv, packed_writes

    calls, kept = {"attention": 0, "indexer": 0, "writes": 0}, {}

    def counted(name, module, attr):
        kernel = kept[module, attr] = getattr(module, attr)

        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        setattr(module, attr, run)

    counted("attention", packed_kv, "sparse_mqa_packed")
    counted("indexer", packed_kv, "indexer_topk_packed")
    counted("writes", packed_writes, "store_fp8_rows")
    counted("writes", packed_writes, "store_fp4_keys")
    try:
        yield calls
    finally:
        for (module, attr), kernel in kept.items():
            setattr(module, attr, kernel)


def lowest_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The reference's choice from scores [T, width]: the best `topk` visible columns, the lowest on ties,
    ascending, -1 unused."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
    visible = torch.gather(scores, 1, order) > float("-inf")
    width = scores.shape[1]
    cols = torch.where(visible, order, width).sort(dim=1).values
    return torch.where(cols < width, cols, -1)


def check_packed_kv_ops(backend, device, dtype=torch.float32, seed=0) -> None:
    """The backend's `sparse_attention_packed` and `indexer_topk_packed` (the kernels) against themselves with
    `read_packed` off (decode the rows read, then the backend's plain kernels): the same attention within the
    dtype's rounding, the same top-k wherever the k-th and (k+1)-th best scores are apart; the packed kernels
    ran for the first and not for the second. A batch-invariant backend (`invariant`) meets exact ties (repeated
    keys, scores exact in fp32): both give the reference's choice, the lowest keys among equals, in every row."""
    g = torch.Generator().manual_seed(seed)
    T, H, d, rope, N, K = 5, 4, 64, 16, 40, 24
    codec, stored = packed_kv_rows(N, d, rope, dtype, g, device)
    q, indices, sinks, positions, inv_freq = attention_case(T, H, d, rope, N, K, dtype, g, device)
    Hi, Di, P, num_pages, rpp, topk = 4, 32, 3, 6, 8, 5
    kcodec, pages = packed_index_pages(num_pages, rpp, Di, dtype, g, device, ties=backend.invariant)
    iq, weights, tables, rows, key_count = index_case(T, 2, Hi, Di, P, num_pages, rpp, dtype, g, device, True,
                                                      exact=backend.invariant)
    results = []
    for read_packed in (True, False):
        backend.read_packed = read_packed
        try:
            with kernel_calls() as calls:
                for fixed_shape in (False, True):
                    results.append(backend.sparse_attention_packed(q, stored, codec, indices, sinks, d ** -0.5,
                                                                   positions, inv_freq, fixed_shape=fixed_shape))
                results.append(backend.indexer_topk_packed(iq, weights, pages, kcodec, tables, key_count, topk, rows))
        finally:
            del backend.read_packed
        assert calls == ({"attention": 2, "indexer": 1, "writes": 0} if read_packed else
                         {"attention": 0, "indexer": 0, "writes": 0})
    for packed, decoded in zip(results[:2], results[3:5]):
        assert rel_err(packed, decoded) < tolerance(dtype)
    scores = reference_index_scores(iq, weights, kcodec.decode(pages), tables, rows, key_count)
    if backend.invariant:  # exact scores with exact ties: both give the lowest keys among equals
        want = lowest_topk(scores, topk)
        assert torch.equal(results[2], want) and torch.equal(results[5], want)
        return
    best = scores.sort(dim=1, descending=True).values
    apart = (best[:, topk - 1] - best[:, topk]).abs() > 1e-3 * best[:, 0].abs().clamp(min=1)
    apart |= key_count <= topk  # every visible key chosen
    assert torch.equal(results[2][apart], results[5][apart])


def check_engine_stores(checkpoint: str) -> None:
    """The tiny demo model on the NVIDIA backend (interpreted) with `kv_cache_dtype="fp8"`, once with the packed
    kernels (rows read in place, written by the write kernels) and once through the decoding fallback and torch's
    encoding (`read_packed`, `write_packed` off), each in a fresh engine: the same greedy tokens and every pool's
    bytes equal after the run (rings, scratch, compressed pages, indexer key pages, snapshots); the packed read and
    write kernels ran in the first only."""
    from deepserve import LLM, SamplingParams

    prompt = {"prompt_token_ids": [(37 * i + 11) % 250 + 30 for i in range(24)]}
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    runs = []
    for packed in (True, False):
        llm = LLM(model=checkpoint, accelerator="nvidia", device="cpu", dtype="bfloat16", kv_cache_dtype="fp8",
                  enforce_eager=True)
        llm.model.backend.write_packed = llm.model.backend.read_packed = packed
        with kernel_calls() as calls:
            tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        assert all((count > 0) == packed for count in calls.values()), calls
        pools = [t.clone() for layer in llm.cache.layers
                 for t in (layer.storage, layer.snap_window, getattr(layer.indexer, "rows", None)) if t is not None]
        assert pools and all(t.dtype == torch.uint8 for t in pools)
        runs.append((tokens, pools))
    assert runs[0][0] == runs[1][0], (runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), "a pool's bytes differ"


def check_engine_static_fp8(checkpoint: str) -> None:
    """The tiny demo model on the NVIDIA backend (interpreted) with `kv_cache_dtype="fp8"`, its decode steps through
    the static forward of CUDA graphs (`DecodeGraphs(capture=False)`: the fused compressor storing packed rows, the
    write kernels, the packed reads) against the paged eager steps (the compressors' torch ops): the same greedy
    tokens, the sampled tokens' logprobs within float noise, and the fused compressor stored packed CSA and HCA
    rows and FP4 keys (blocks of 4 and 16 close during the 5 decode steps at positions 13-17)."""
    from deepserve import LLM, SamplingParams
    from deepserve.backends.nvidia.triton_ops import decode
    from deepserve.model.cuda_graphs import DecodeGraphs

    prompt = {"prompt_token_ids": [(37 * i + 11) % 200 + 30 for i in range(13)]}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    runs, stores, steps, fused = [], [], [], decode.compress_decode
    signature = inspect.signature(fused)

    def counted(*args, **kwargs):  # the `store` argument by name, wherever the caller put it
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        stores.append(bound.arguments["store"])
        return fused(*args, **kwargs)

    for static in (False, True):
        llm = LLM(model=checkpoint, accelerator="nvidia", device="cpu", dtype="bfloat16", kv_cache_dtype="fp8",
                  enforce_eager=True, block_size=128)
        if static:
            llm.runner.graphs = graphs = DecodeGraphs(llm.model, llm.cache, 1, 2, capture=False)
            forward = graphs.forward

            def step(*args, **kwargs):
                steps.append(1)
                return forward(*args, **kwargs)
            graphs.forward = step
        decode.compress_decode = counted
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        finally:
            decode.compress_decode = fused
        runs.append((list(out.token_ids), [next(iter(p.values())).logprob for p in out.logprobs]))
    # every decode step static, each storing the 2 CSA and 2 HCA layers' rows (FP8) and the CSA indexers' keys (FP4)
    assert len(steps) == 5 and stores.count("fp8") == 4 * 5 and stores.count("fp4") == 2 * 5, (len(steps), stores)
    assert runs[0][0] == runs[1][0], (runs[0][0], runs[1][0])
    diff = max(abs(a - b) for a, b in zip(runs[0][1], runs[1][1]))
    assert diff < 0.05, diff


# -- on the CPU, interpreted ---------------------------------------------------------------------------------------

CASES = {
    # attention: one part, then the list split into parts (merged, the sink in part 0); a short FP8 block (nope 48)
    "attention-fp32": (check_sparse_mqa_packed, dict(T=6, H=5, d=64, rope=16, N=50, K=40)),
    "attention-bf16-split": (check_sparse_mqa_packed, dict(T=3, H=16, d=128, rope=32, N=70, K=150,
                                                           dtype=torch.bfloat16, splits=4)),
    "attention-short-block": (check_sparse_mqa_packed, dict(T=4, H=3, d=64, rope=16, N=20, K=70, splits=2)),
    # a lone query (a batch-1 decode step) in parts: the case the H200 run found the check itself broken for
    "attention-one-query": (check_sparse_mqa_packed, dict(T=1, H=4, d=64, rope=16, N=30, K=90, splits=4)),
    # V4's rows (the non-RoPE dims in whole 64-dim scale blocks, then 64 RoPE dims): decoded a block at a time
    "attention-v4-rows": (check_sparse_mqa_packed, dict(T=3, H=4, d=512, rope=64, N=40, K=70)),
    "attention-v4-rows-bf16-split": (check_sparse_mqa_packed, dict(T=2, H=16, d=256, rope=64, N=60, K=100,
                                                                   dtype=torch.bfloat16, splits=2)),
    # indexer: per-query table rows of a paged step; one table row per query (the fixed-shape step); Di 16 (one
    # short scale block, the tiny model's)
    "index-scores-query-rows": (check_packed_index_scores, dict(T=7, B=3, Hi=4, Di=64, P=3, num_pages=9, rpp=16)),
    "index-scores-bf16": (check_packed_index_scores, dict(T=5, B=5, Hi=16, Di=128, P=2, num_pages=6, rpp=64,
                                                          dtype=torch.bfloat16, query_rows=False)),
    "index-scores-di16": (check_packed_index_scores, dict(T=4, B=2, Hi=3, Di=16, P=4, num_pages=5, rpp=4)),
    # keys of whole words (V4's 128 dims, and 256), decoded eight codes a word as the FP4 experts are
    "index-scores-words": (check_packed_index_scores, dict(T=6, B=3, Hi=4, Di=128, P=3, num_pages=8, rpp=16)),
    "index-scores-words-256": (check_packed_index_scores, dict(T=3, B=2, Hi=2, Di=256, P=2, num_pages=4, rpp=8,
                                                               dtype=torch.bfloat16)),
    # writes: V4-Flash's rows and keys (fp32 and bf16 inputs); the tiny model's (one short FP8 block, 16-value keys)
    "store-fp8-flash": (check_store_rows, dict(kind="fp8", width=512, rope=64)),
    "store-fp8-flash-bf16": (check_store_rows, dict(kind="fp8", width=512, rope=64, dtype=torch.bfloat16, seed=1)),
    "store-fp8-tiny": (check_store_rows, dict(kind="fp8", width=32, rope=16, seed=2)),
    "store-fp4-flash": (check_store_rows, dict(kind="fp4", width=128, seed=3)),
    "store-fp4-tiny-bf16": (check_store_rows, dict(kind="fp4", width=16, dtype=torch.bfloat16, seed=4)),
}


def run_cases(checkpoint: str) -> dict[str, str]:
    """Every case under this process's triton (the child's entry point): name -> 'ok' or the failure."""
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.backends.nvidia.triton_ops import packed_kv, packed_writes

    kernels, results = SimpleNamespace(packed_kv=packed_kv, packed_writes=packed_writes), {}
    checks = {name: (lambda check=check, kwargs=kwargs: check(kernels, "cpu", **kwargs))
              for name, (check, kwargs) in CASES.items()}
    backend = NvidiaBackend(device="cpu")
    checks["backend-ops-fp32"] = lambda: check_packed_kv_ops(backend, "cpu")
    checks["backend-ops-bf16"] = lambda: check_packed_kv_ops(backend, "cpu", torch.bfloat16, seed=1)
    invariant = NvidiaBackend(device="cpu", invariant=True)
    checks["backend-ops-invariant"] = lambda: check_packed_kv_ops(invariant, "cpu", seed=2)
    checks["engine-stores"] = lambda: check_engine_stores(checkpoint)
    checks["engine-static-fp8"] = lambda: check_engine_static_fp8(checkpoint)
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test by name
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, str]:
    if torch.cuda.is_available():
        pytest.skip("with a GPU these run as tests/gpu/test_kv_fp8_kernels.py")
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    checkpoint = build_demo_checkpoint(tmp_path_factory.mktemp("demo"))
    return run_child(__file__, checkpoint, timeout=600, gpu_twin="tests/gpu/test_kv_fp8_kernels.py")


@pytest.mark.parametrize("case", [*CASES, "backend-ops-fp32", "backend-ops-bf16", "backend-ops-invariant",
                                  "engine-stores", "engine-static-fp8"])
def test_packed_reads_against_decoded_rows(interpreted, case):
    assert interpreted[case] == "ok", interpreted[case]


if __name__ == "__main__":
    child_main(run_cases, sys.argv[1])
