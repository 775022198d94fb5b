"""SWA replay (`deepserve.model.swa_replay`): a page's boundary snapshot rebuilt from its compressed rows and the
tokens before the boundary. On the tiny model (6 layers, window 16): a replay of window x depth tokens rebuilds
the snapshot the forward stored, and a prefix hit on it gives the cold run's tokens; a shorter one is visibly
approximate."""

from __future__ import annotations

import random

import torch

from deepserve import LLM, SamplingParams
from deepserve.core.kv.prefix_hash import block_hashes
from deepserve.model.swa_replay import BOUNDED_LENGTH, exact_length, replay_snapshot

P = 128


def snapshot(cache, page) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        out.append(layer.snap_window[page].clone())
        for pools in (layer.compressor, layer.indexer):
            if pools is not None and pools.spec.overlap:
                out += [pools.snap_kv[page].clone(), pools.snap_gate[page].clone()]
    return out


def test_a_window_times_depth_replay_rebuilds_the_snapshot_and_a_short_one_approximates_it(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P)
    rng = random.Random(5)
    prompt = [rng.randrange(2, 512) for _ in range(2 * P + 20)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    cold = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    kv, cache = llm.engine.scheduler.kv, llm.runner.cache
    table = [kv.pool.get_cached(h) for h in block_hashes(prompt[:2 * P], P, None)]
    assert None not in table
    stored = snapshot(cache, table[-1])
    assert exact_length(cache) == 16 * 6 <= BOUNDED_LENGTH  # the tiny model: bounded replay is exact here

    assert replay_snapshot(cache, table, 2 * P, prompt, 24) == 24
    short = snapshot(cache, table[-1])
    assert max((a - b).abs().max().item() for a, b in zip(short, stored)) > 1e-3  # 24 < 96 tokens: approximate

    assert replay_snapshot(cache, table, 2 * P, prompt, exact_length(cache)) == 96
    for a, b in zip(snapshot(cache, table[-1]), stored):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    warm = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]  # hits the rebuilt page
    assert warm.num_cached_tokens == 2 * P and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for t, a, b in zip(cold.outputs[0].token_ids, warm.outputs[0].logprobs, cold.outputs[0].logprobs):
        assert abs(a[t].logprob - b[t].logprob) < 1e-3


def test_a_store_without_window_snapshots_is_hit_through_an_swa_replay(tiny_dir, tmp_path):
    rng = random.Random(6)
    prompt = [rng.randrange(2, 512) for _ in range(2 * P + 20)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)

    def engine(mode):
        return LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, kv_store=f"dir://{tmp_path}/{mode}",
                   kv_store_snapshots=False, swa_replay=mode)

    def run(llm):
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]

    for mode, replayed in (("bounded", BOUNDED_LENGTH), ("exact", 96)):
        first = engine(mode)
        cold = run(first)
        first.engine.kv_tiers.flush(5.0)
        assert list(tmp_path.glob(f"{mode}/**/layers_csa")) and not list(tmp_path.glob(f"{mode}/**/layers_snapshot"))
        second = engine(mode)  # a restart: its pages come from the store, without their snapshots
        warm = run(second)
        assert warm.num_cached_tokens == 2 * P and second.engine.num_replayed_tokens == replayed
        assert warm.outputs[0].token_ids == cold.outputs[0].token_ids  # the tiny model's 96 <= 128: both exact
        for t, a, b in zip(cold.outputs[0].token_ids, warm.outputs[0].logprobs, cold.outputs[0].logprobs):
            assert abs(a[t].logprob - b[t].logprob) < 1e-3
        again = run(second)  # a GPU hit on the replayed page: nothing to replay
        assert again.num_cached_tokens == 2 * P and second.engine.num_replayed_tokens == replayed
