"""The MTP drafter's chain as the static forwards its CUDA graphs capture (`deepserve.model.draft_graphs`), run
eagerly on the CPU reference backend: the same drafts, confidences and MTP window rings as the eager chain, bit
for bit, over batches that pad up to every bucket and positions that wrap the window; steps it cannot take
(sampled drafters, more sequences than its largest bucket) go to the eager chain. Through the engine, greedy
tokens with the chain's graphs equal the eager speculative run's and plain greedy decoding's, for MTP and DSpark.
Capture and replay themselves are checked on the GPU (tests/gpu/test_spec_graphs_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

import tiny

from deepserve.model.batch import make_batch
from deepserve.model.draft_graphs import DraftChainGraphs
from deepserve.model.kv_cache import PagedKVCache
from deepserve.model.speculative import DraftChunk, RowSampling
from deepserve.plugins.speculative.mtp import MTPProposer

PAGE = 64  # window 16 in the demo model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.demo_model(tmp_path_factory, seed=5)


def _greedy(n: int) -> RowSampling:
    zeros = torch.zeros(n)
    return RowSampling(zeros, zeros.long(), torch.ones(n), zeros, zeros.long(), all_greedy=True)


def _mtp_rings(cache: PagedKVCache) -> list[torch.Tensor]:
    return [p.window[: cache.num_slots] for p in cache.pools["mtp_layers"]]


@pytest.mark.parametrize("with_confidences", [False, True])
@torch.inference_mode()
def test_static_chain_equals_eager_chain(model, with_confidences):
    rng = random.Random(int(with_confidences))
    k, num_slots = 5, 9
    owners = model.default_state_owners + MTPProposer.state_owners
    caches = [PagedKVCache(model, 40, PAGE, num_slots, owners=owners) for _ in range(2)]
    proposers = [MTPProposer(model, k, with_confidences=with_confidences) for _ in range(2)]
    made = proposers[1].capture_graphs(caches[1], max_batch=8, batch_sizes=[1, 3, 8], capture=False)
    graphs = proposers[1].chain_graphs
    assert made == 3 and not graphs.capture and graphs.batch_buckets == [1, 3, 8]
    calls = []
    run = graphs.run
    graphs.run = lambda *a: calls.append(len(a[2])) or run(*a)
    seqs = []
    for i in range(num_slots):
        table = [3 * i, 3 * i + 1, 3 * i + 2]
        prompt = [rng.randrange(2, 258) for _ in range(rng.randrange(1, 40))]
        seqs.append((prompt, [cache.new_sequence(table)[0] for cache in caches]))
    new = {i: list(p) for i, (p, _) in enumerate(seqs)}  # each sequence's tokens not yet computed
    for step in range(14):
        which = rng.sample(range(num_slots), rng.randrange(1, num_slots + 1))  # 9 > 8: some steps go eager
        nxt = {i: rng.randrange(2, 258) for i in which}
        drafts = []
        for c in range(2):
            states = [seqs[i][1][c] for i in which]
            starts = [st.num_tokens for st in states]
            batch = make_batch([new[i] for i in which], starts, "cpu",
                               logits_rows=[range(len(new[i])) for i in which])
            out = model(batch, states)
            chunks = [DraftChunk(st, s, len(new[i]), range(bc.offset, bc.offset + bc.length),
                                 new[i][1:] + [nxt[i]], k)
                      for i, st, s, bc in zip(which, states, starts, batch.chunks)]
            drafts.append(proposers[c].propose(out.streams, chunks, _greedy(len(which))))
        eager, static = drafts
        assert torch.equal(eager.token_ids, static.token_ids), f"step {step}"
        assert static.probs is None
        if with_confidences:
            assert torch.equal(eager.confidences.float(), static.confidences), f"step {step}"
        for x, y in zip(_mtp_rings(caches[0]), _mtp_rings(caches[1])):
            assert torch.equal(x, y), f"step {step}"
        for _, (a, b) in seqs:
            assert a.mtp_num_tokens == b.mtp_num_tokens and a.num_tokens == b.num_tokens
        for n, i in enumerate(which):  # keep the base token and a random number of the drafts as next input
            new[i] = [nxt[i]] + eager.token_ids[n, : rng.randrange(0, k)].tolist()
    assert len(calls) >= 8 and {1, 3, 8} & set(calls)  # most steps ran the static chain
    assert max(st.num_tokens for _, (st, _) in seqs) > 2 * 16  # the chain wrapped the window


@torch.inference_mode()
def test_chain_declines_what_it_cannot_run(model):
    cache = PagedKVCache(model, 8, PAGE, 3, owners=model.default_state_owners + MTPProposer.state_owners)
    graphs = DraftChainGraphs(MTPProposer(model, 3), cache, max_batch=2, capture=False)
    assert graphs.batch_buckets == [1, 2]
    assert graphs.supports(2, all_greedy=True)
    assert not graphs.supports(2, all_greedy=False)  # a sampled drafter keeps q: the eager chain
    assert not graphs.supports(3, all_greedy=True)  # past the largest bucket
    assert MTPProposer(model, 1).capture_graphs(cache, max_batch=2, capture=False) == 0  # no chain for k = 1
    with pytest.raises(ValueError, match="num_speculative_tokens >= 2"):
        DraftChainGraphs(MTPProposer(model, 1), cache, max_batch=2, capture=False)
    with pytest.raises(ValueError, match="mtp_layers"):
        DraftChainGraphs(MTPProposer(model, 3), PagedKVCache(model, 8, PAGE, 3), max_batch=2, capture=False)
    with pytest.raises(ValueError, match="CUDA"):
        DraftChainGraphs(MTPProposer(model, 3), cache, max_batch=2, capture=True)
    with pytest.raises(ValueError, match="batch_sizes"):
        DraftChainGraphs(MTPProposer(model, 3), cache, max_batch=2, capture=False, batch_sizes=[])


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_engine_greedy_with_chain_graphs_equals_eager_and_plain(tmp_path, method):
    from deepserve import LLM, SamplingParams
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path / "m", seed=2)
    prompts = [[5, 6, 7, 8], list(range(10, 110)), [9] * 33]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 4}
    outs = {}
    for name in ("plain", "eager", "chain"):
        llm = LLM(path, dtype="float32", max_num_seqs=4, speculative_config=None if name == "plain" else spec)
        if name == "chain":
            assert llm.proposer.capture_graphs(llm.cache, max_batch=4, capture=False) == 3
            calls = []
            run = llm.proposer.chain_graphs.run
            llm.proposer.chain_graphs.run = lambda *a: calls.append(1) or run(*a)
        outs[name] = [o.outputs[0].token_ids for o in
                      llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert len(calls) > 5
    assert outs["chain"] == outs["eager"] == outs["plain"]
