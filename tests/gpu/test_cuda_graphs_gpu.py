"""On an NVIDIA GPU: decode steps replayed from CUDA graphs (`DecodeGraphs`) against the same steps launched
eagerly over a twin cache (fp32, the backend's kernels in both), the paged indexer kernel against the reference,
and the engine with graphs on against `enforce_eager`."""

from __future__ import annotations

import random

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.backends.reference import ReferenceBackend

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

PAGE = 64  # window 16, CSA ratio 4, HCA ratio 16 in the demo model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo-graphs-gpu"), seed=7)


def _snaps(table, start, n):
    return [(b, table[b // PAGE - 1]) for b in range((start // PAGE + 1) * PAGE, start + n + 1, PAGE)]


@torch.inference_mode()
def test_graph_replay_matches_eager_decode(demo_dir):
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.model.batch import make_batch
    from deepserve.model.cuda_graphs import DecodeGraphs
    from deepserve.model.factory import load_model
    from deepserve.model.kv_cache import PagedKVCache

    backend = NvidiaBackend("cuda:0")
    assert backend.cuda_graphs
    model = load_model(demo_dir, backend, dtype="float32", progress=False)
    rng = random.Random(0)
    num_slots = 10
    caches = [PagedKVCache(model, 60, PAGE, num_slots) for _ in range(2)]
    graphs = DecodeGraphs(model, caches[1], max_batch=num_slots, max_pages=5)
    assert graphs.capture
    seqs, next_page = [], 0
    for _ in range(num_slots):
        n = rng.choice([1, 15, 63, rng.randrange(1, 200)])
        table = list(range(next_page, next_page + (n + 40) // PAGE + 1))
        next_page += len(table)
        prompt = [rng.randrange(2, 258) for _ in range(n)]
        states = []
        for cache in caches:
            st = cache.new_sequence(table)[0]
            model(make_batch([prompt], [0], "cuda:0", snapshots=[_snaps(table, 0, n)]), [st])
            states.append(st)
        seqs.append((table, states))
    worst, agree, total = 0.0, 0, 0
    for step in range(30):
        which = rng.sample(range(num_slots), rng.randrange(1, num_slots + 1))
        tokens = [rng.randrange(2, 258) for _ in which]
        logits = []
        for k, cache in enumerate(caches):
            states = [seqs[i][1][k] for i in which]
            starts = [st.num_tokens for st in states]
            batch = make_batch([[t] for t in tokens], starts, "cuda:0",
                               snapshots=[_snaps(seqs[i][0], s, 1) for i, s in zip(which, starts)])
            if k == 0:
                logits.append(model(batch, states).logits.clone())
            else:
                assert graphs.supports(batch, states)
                logits.append(graphs.forward(batch, states).logits.clone())
        worst = max(worst, float((logits[0] - logits[1]).abs().max()))
        agree += int((logits[0].argmax(-1) == logits[1].argmax(-1)).sum())
        total += len(which)
    assert all(b.graph is not None for b in graphs._buckets.values()) and len(graphs._buckets) >= 3
    assert worst < 1e-3, worst
    assert agree == total
    for (_, (a, b)) in seqs:
        assert a.num_tokens == b.num_tokens


def test_paged_indexer_kernel_matches_reference():
    from deepserve.backends.nvidia.triton_ops.indexer import indexer_topk_paged

    g = torch.Generator(device="cuda").manual_seed(0)
    T, Hi, Di, rpp, P, pages, topk = 48, 64, 128, 64, 12, 700, 512
    q = torch.randn((T, Hi, Di), generator=g, device="cuda").bfloat16()
    weights = torch.randn((T, Hi), generator=g, device="cuda") * Hi**-0.5
    pool = torch.randn((pages, rpp, Di), generator=g, device="cuda").bfloat16()
    tables = torch.randint(0, pages, (T, P), generator=g, device="cuda")
    count = torch.randint(0, P * rpp + 1, (T,), generator=g, device="cuda")
    count[0], count[1] = P * rpp, 3
    chosen = indexer_topk_paged(q, weights, pool, tables, count, topk)
    expect = ReferenceBackend("cuda").indexer_topk_paged(q.float(), weights, pool.float(), tables, count, topk)
    assert torch.equal(chosen >= 0, expect >= 0)
    overlap = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(chosen, expect))
    assert overlap / int((expect >= 0).sum()) > 0.98  # bf16 scores: near-ties may swap
    valid = chosen >= 0
    assert bool(((chosen < count[:, None]) | ~valid).all())


def test_linear_fp32_is_the_fp32_product():
    from deepserve.backends.nvidia import NvidiaBackend

    backend = NvidiaBackend("cuda:0")
    x = torch.randn(5, 4096, device="cuda").bfloat16()
    w = torch.randn(129280, 4096, device="cuda").bfloat16()
    out = backend.linear_fp32(x, w)
    assert out is not None and out.dtype == torch.float32
    ref = x.double() @ w.double().t()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_engine_with_graphs_equals_enforce_eager(demo_dir):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (5, 70, 130, 33)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)] * 2
    outs = []
    for eager in (True, False):
        llm = LLM(demo_dir, dtype="float32", accelerator="nvidia", max_num_seqs=8, enforce_eager=eager)
        assert (llm.graphs is None) == eager
        outs.append([o.outputs[0].token_ids for o in
                     llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
        if not eager:
            assert llm.graphs._buckets and all(b.graph is not None for b in llm.graphs._buckets.values())
    assert sum(a == b for a, b in zip(*outs)) >= 3  # fp32 kernels: equal up to rare near-ties
