"""On an NVIDIA GPU: speculative steps with CUDA graphs (the MTP drafter's chain, `draft_graphs`, and the target's
verify steps, `verify_graphs`) against the same steps launched eagerly: each replay gives its static forward's
bits; through the engine, greedy tokens with graphs equal the eager speculative run's and plain
greedy decoding's, on the fp32 demo model and on a bf16 model with V4-Flash's layer shapes (two layers, few
experts, an MTP block)."""

from __future__ import annotations

import random

import pytest
import torch

from deepserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo-spec-graphs-gpu"), seed=7)


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    """V4-Flash's per-layer shapes (bench/gpu.py's), layers SW and CSA, 8 experts, one MTP block, random bf16."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu as base
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.model.writer import save_checkpoint

    layers = ["sliding_attention", "compressed_sparse_attention"]
    cfg = dict(base.V4_FLASH_LAYER, n_routed_experts=8, layer_types=layers, num_hidden_layers=2,
               mlp_layer_types=["hash_moe", "moe"], num_nextn_predict_layers=1)
    model = base.build(cfg, NvidiaBackend("cuda:0"), torch.bfloat16, seed=3)
    path = tmp_path_factory.mktemp("flash-spec-graphs-gpu")
    save_checkpoint(model, path)
    del model
    torch.cuda.empty_cache()
    return path


@torch.inference_mode()
def test_chain_replay_matches_its_static_forward(demo_dir):
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.model.batch import make_batch
    from deepserve.model.factory import load_model
    from deepserve.model.kv_cache import PagedKVCache
    from deepserve.model.speculative import DraftChunk, RowSampling
    from deepserve.plugins.speculative.mtp import MTPProposer

    model = load_model(demo_dir, NvidiaBackend("cuda:0"), dtype="float32", progress=False)
    rng, k, num_slots = random.Random(0), 5, 8
    owners = model.default_state_owners + MTPProposer.state_owners
    caches = [PagedKVCache(model, 40, 64, num_slots, owners=owners) for _ in range(2)]
    proposers = [MTPProposer(model, k, with_confidences=True) for _ in range(2)]
    for proposer, cache, capture in zip(proposers, caches, (False, True)):
        proposer.capture_graphs(cache, max_batch=num_slots, capture=capture)
    assert all(b.graph is not None for b in proposers[1].chain_graphs._buckets.values())
    states = [[cache.new_sequence([4 * i + j for j in range(4)])[0] for i in range(num_slots)] for cache in caches]
    new = [[rng.randrange(2, 258) for _ in range(rng.randrange(1, 60))] for _ in range(num_slots)]
    for step in range(12):
        which = rng.sample(range(num_slots), rng.randrange(1, num_slots + 1))
        nxt = {i: rng.randrange(2, 258) for i in which}
        drafts = []
        for c in range(2):
            sts = [states[c][i] for i in which]
            starts = [st.num_tokens for st in sts]
            batch = make_batch([new[i] for i in which], starts, "cuda:0",
                               logits_rows=[range(len(new[i])) for i in which])
            out = model(batch, sts)
            chunks = [DraftChunk(st, s, len(new[i]), range(bc.offset, bc.offset + bc.length), new[i][1:] + [nxt[i]],
                                 k) for i, st, s, bc in zip(which, sts, starts, batch.chunks)]
            zeros = torch.zeros(len(which), device="cuda:0")
            sampling = RowSampling(zeros, zeros.long(), zeros + 1, zeros, zeros.long(), all_greedy=True)
            drafts.append(proposers[c].propose(out.streams, chunks, sampling))
        assert torch.equal(drafts[0].token_ids, drafts[1].token_ids), f"step {step}"
        assert torch.equal(drafts[0].confidences, drafts[1].confidences), f"step {step}"
        for x, y in zip(caches[0].pools["mtp_layers"], caches[1].pools["mtp_layers"]):
            assert torch.equal(x.window[:num_slots], y.window[:num_slots]), f"step {step}"
        for n, i in enumerate(which):
            new[i] = [nxt[i]] + drafts[0].token_ids[n, : rng.randrange(0, k)].tolist()


@pytest.mark.parametrize("which", ["demo", "flash"])
@torch.inference_mode()
def test_verify_replay_matches_its_static_forward(request, which):
    """The target's verify steps (`verify_graphs`): each bucket's replays (the pass, then the rollback) against the
    same static forward and rollback run eagerly, over random steps of 1 + 4 tokens a sequence, each rolled back to
    a random kept count."""
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.model.batch import make_batch
    from deepserve.model.factory import load_model
    from deepserve.model.kv_cache import PagedKVCache
    from deepserve.model.verify_graphs import VerifyGraphs

    dtype = "float32" if which == "demo" else "bfloat16"
    model = load_model(request.getfixturevalue(f"{which}_dir"), NvidiaBackend("cuda:0"), dtype=dtype, progress=False)
    vocab, width, num_slots, page = model.cfg.vocab_size, 5, 8, 64
    rng = random.Random(2)
    caches = [PagedKVCache(model, 8 * num_slots, page, num_slots) for _ in range(2)]
    graphs = [VerifyGraphs(model, cache, num_slots, 8, width, capture=capture)
              for cache, capture in zip(caches, (False, True))]
    graphs[1].warm_up(progress=False)
    assert all(b.graph is not None for b in graphs[1]._buckets.values())
    states = []
    for c, cache in enumerate(caches):
        states.append([cache.new_sequence([8 * i + j for j in range(8)])[0] for i in range(num_slots)])
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(1, 200))] for _ in range(num_slots)]
    for c in range(2):
        for st, prompt in zip(states[c], prompts):
            model(make_batch([prompt], [0], "cuda:0"), [st])
    for step in range(16):
        which_seqs = rng.sample(range(num_slots), rng.randrange(1, num_slots + 1))
        tokens = [[rng.randrange(2, vocab) for _ in range(width)] for _ in which_seqs]
        kept = [rng.randrange(1, width + 1) for _ in which_seqs]
        logits = []
        for c in range(2):
            sts = [states[c][i] for i in which_seqs]
            starts = [st.num_tokens for st in sts]
            batch = make_batch(tokens, starts, "cuda:0", logits_rows=[range(width)] * len(sts))
            assert graphs[c].supports(batch.chunks, sts)
            undo = graphs[c].begin(batch, sts)
            logits.append(graphs[c].forward(batch, sts).logits.clone())
            for u, s, a in zip(undo, starts, kept):
                u.rollback(s + a) if a < width else u.commit()
        assert torch.equal(logits[0], logits[1]), f"step {step}"
    for x, y in zip(caches[0].layers, caches[1].layers):  # the rollbacks' replays left the same rings and pages
        assert torch.equal(x.window[:num_slots], y.window[:num_slots])
        for sx, sy in ((x.compressor, y.compressor), (x.indexer, y.indexer)):
            if sx is not None:
                assert torch.equal(sx.rows[: 8 * num_slots], sy.rows[: 8 * num_slots])


def _generate(path, dtype, spec, eager, prompts, max_tokens, max_num_seqs):
    llm = LLM(path, dtype=dtype, accelerator="nvidia", max_num_seqs=max_num_seqs, enforce_eager=eager,
              speculative_config=spec, max_model_len=1024, kv_cache_bytes=4 << 30, load_plugins=False)
    if not eager and spec is None:
        assert llm.graphs is not None and llm.graphs._buckets
    if not eager and spec is not None:
        chain = llm.proposer.chain_graphs
        assert chain is not None and chain._buckets and all(b.graph is not None for b in chain._buckets.values())
        verify = llm.runner.verify_graphs
        assert verify is not None and all(b.graph is not None for b in verify._buckets.values())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    accepted = sum(o.num_accepted_tokens or 0 for o in outs)
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], accepted


@pytest.mark.parametrize("method", ["mtp", "dspark"])
@pytest.mark.parametrize("which", ["demo", "flash"])
def test_engine_spec_graphs_equal_eager_and_plain(request, method, which):
    path = request.getfixturevalue(f"{which}_dir")
    dtype = "float32" if which == "demo" else "bfloat16"
    vocab = 258 if which == "demo" else 129280
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 70, 130, 33, 200, 1)]
    spec = {"method": method, "num_speculative_tokens": 4}
    graphs, _ = _generate(path, dtype, spec, False, prompts, 48, 8)
    eager, accepted = _generate(path, dtype, spec, True, prompts, 48, 8)
    plain, _ = _generate(path, dtype, None, False, prompts, 48, 8)
    same_eager = sum(a == b for a, b in zip(graphs, eager))
    same_plain = sum(a == b for a, b in zip(graphs, plain))
    print(f"{which} {method}: graphs == eager speculative on {same_eager}/6, == plain greedy on {same_plain}/6, "
          f"{accepted} drafts accepted eagerly")
    assert same_eager == len(prompts)
    if which == "demo":  # fp32: plain decoding's kernels differ, a rare near-tie may flip a token
        assert same_plain >= len(prompts) - 1
    # bf16 random weights at V4-Flash shapes: the eager verify pass and plain decoding's graphs resolve near-ties
    # differently (half of these sequences part from plain greedy on the H200, with or without the chain's graphs)
