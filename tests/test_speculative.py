"""Speculative decoding end to end: with greedy sampling the engine's tokens are exactly the non-speculative
ones, through continuous batching, prefix-cache hits, forced preemption and aborts, with asynchronous
scheduling (drafts verified as placeholders, relative chunks) and without, on a random tiny model
(drafts nearly always rejected: rollback every step) and on the embedded trained model (drafts often kept);
every page, slot and draft is released at the end; configuration errors name the field."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import deepserve
from deepserve import LLM, SamplingParams
from deepserve.core.config import SpeculativeConfig
from test_engine import serve  # requests arriving at given steps, aborts at given steps

EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
SPEC = {"method": "mtp", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo-spec-engine"), seed=11)


def make_llm(path, **kw):
    kw.setdefault("block_size", 128)
    return LLM(path, dtype="float32", accelerator="cpu", load_plugins=False, **kw)


def workload(n, seed, vocab, shared=None, max_prompt=150):
    """(arrival step, prompt ids, params): greedy requests of random lengths, and a few seeded sampled ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = (shared or []) + [rng.randrange(2, vocab) for _ in range(rng.randint(1, max_prompt))]
        if i % 4 == 3:
            params = SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=rng.randint(1, 16),
                                    ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        out.append((rng.randint(0, 6), prompt, params))
    return out


def tokens_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def greedy(items, outs):
    return [o.outputs[0].token_ids for (_, _, sp), o in zip(items, outs) if sp.temperature == 0]


def assert_everything_free(llm):
    assert not llm.engine.has_unfinished_requests()
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.pool.num_blocks
    assert not llm.kv_manager.block_tables
    assert llm.runner.num_active_sequences == 0 and llm.cache.num_free_slots == llm.cache.num_slots
    assert llm.runner.speculation is None or llm.runner.speculation.num_requests_held == 0


@pytest.fixture(scope="module")
def embedded_pair():
    return make_llm(EMBEDDED), make_llm(EMBEDDED, speculative_config=SPEC)


@pytest.fixture(scope="module")
def demo_pair(demo_dir):
    return make_llm(demo_dir), make_llm(demo_dir, speculative_config=SPEC)


@pytest.mark.parametrize("which", ["embedded", "demo"])
def test_greedy_tokens_equal_non_speculative_for_a_mixed_batch(which, embedded_pair, demo_pair):
    plain, spec = embedded_pair if which == "embedded" else demo_pair
    items = workload(14, seed=3, vocab=plain.model.cfg.vocab_size)
    ref, outs = serve(plain, items), serve(spec, items)
    assert greedy(items, outs) == greedy(items, ref)
    stats = spec.engine.stats.spec
    assert stats.num_verified_tokens > 0 and stats.num_draft_tokens >= stats.num_verified_tokens
    if which == "embedded":  # a trained drafter: drafts are kept, so several tokens per step
        assert stats.num_accepted_tokens > 0.2 * stats.num_verified_tokens
    assert sum(o.num_verified_tokens for o in outs) == stats.num_verified_tokens
    assert sum(o.num_accepted_tokens for o in outs) == stats.num_accepted_tokens
    assert all(o.num_accepted_tokens <= o.num_verified_tokens <= o.num_draft_tokens for o in outs)
    assert all(o.num_verified_tokens == 0 for o in ref)
    # a seeded sampled request gets the same tokens alone as in the busy batch
    i = next(i for i, (_, _, sp) in enumerate(items) if sp.temperature > 0)
    alone = spec.generate([{"prompt_token_ids": items[i][1]}], items[i][2], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[i].outputs[0].token_ids
    assert_everything_free(spec)


def test_prefix_hits_preemption_and_aborts(demo_dir, embedded_pair):
    from deepserve.model.kv_cache import bytes_per_page

    plain, _ = embedded_pair
    rng = random.Random(5)
    vocab = plain.model.cfg.vocab_size
    shared = [rng.randrange(2, vocab) for _ in range(300)]
    items = [(i * 2, shared[:cut] + [rng.randrange(2, vocab) for _ in range(rng.randint(1, 20))],
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
             for i, cut in enumerate([130, 257, 290, 257, 140])]
    ref = serve(plain, items)
    spec = make_llm(EMBEDDED, speculative_config=SPEC)
    outs = serve(spec, items)
    assert tokens_of(outs) == tokens_of(ref)
    assert sorted({o.num_cached_tokens for o in outs}) == [0, 128, 256]
    assert_everything_free(spec)

    # pages for 5 requests of ~115 tokens growing past a page: preemption by recompute, drafts and all
    page = bytes_per_page(spec.model, 128, torch.float32, ("layers", "mtp_layers"))
    crowd = [(rng.randint(0, 3), [rng.randrange(2, vocab) for _ in range(rng.randint(100, 120))],
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for _ in range(7)]
    ref_tokens = tokens_of(serve(plain, crowd))
    for async_scheduling in (False, True):  # preempted while a verify step is in flight, or not
        small = make_llm(EMBEDDED, speculative_config=SPEC, kv_cache_bytes=5 * page,
                         async_scheduling=async_scheduling)
        assert tokens_of(serve(small, crowd)) == ref_tokens
        assert small.engine.scheduler.num_preemptions > 0
        assert_everything_free(small)

    aborts = [(2, [0, 3]), (5, [5, 6])]
    outs = serve(small, crowd, aborts)
    aborted = {f"w{j}" for _, ids in aborts for j in ids}
    assert {o.request_id for o in outs if o.outputs[0].finish_reason == "abort"} <= aborted
    done = [i for i, o in enumerate(outs) if o.outputs[0].finish_reason != "abort"]
    assert [outs[i].outputs[0].token_ids for i in done] == [ref_tokens[i] for i in done]
    assert_everything_free(small)


def test_stops_inside_kept_drafts(embedded_pair):
    """EOS, stop ids and max_tokens cut a step's kept drafts exactly where plain decoding stops."""
    plain, spec = embedded_pair
    prompt = [{"prompt_token_ids": [60, 61, 62, 63, 64, 65]}]
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[9]
    stop_text = plain.tokenizer.decode(full[12:14])
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, stop=[stop_text], ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=13, stop=[stop_text], ignore_eos=True)):
        a = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        b = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason)


def test_dspark_keeps_greedy_tokens_and_plans_lengths(embedded_pair):
    plain, _ = embedded_pair
    dspark = make_llm(EMBEDDED, speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    items = workload(8, seed=9, vocab=plain.model.cfg.vocab_size)
    assert greedy(items, serve(dspark, items)) == greedy(items, serve(plain, items))
    stats = dspark.engine.stats.spec
    assert 0 < stats.num_verified_tokens <= stats.num_draft_tokens
    assert len(stats.verified_by_position) <= 4
    assert dspark.engine.verify_planner.curve.num_observations > 0
    assert_everything_free(dspark)


@pytest.mark.parametrize("value,message", [
    ({"method": ""}, "speculative_config.method"),
    ({"num_speculative_tokens": 3}, "speculative_config.method is required"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": "5"}, "speculative_config.num_speculative_tokens"),
    ({"method": "mtp", "k": 5}, r"unknown field\(s\) \['k'\]"),
    ("{not json", "speculative_config is not valid JSON"),
    (["mtp"], "speculative_config must be a dict"),
])
def test_bad_config_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_config_sources(demo_dir, monkeypatch):
    assert SpeculativeConfig.parse('{"method": "dspark"}') == SpeculativeConfig("dspark", 5)
    assert SpeculativeConfig.parse(None) is None
    with pytest.raises(ValueError, match=r"method 'eagle' is not a registered proposer; available: \['dspark', 'mtp'\]"):
        make_llm(demo_dir, speculative_config={"method": "eagle"})
    monkeypatch.setenv("DEEPSERVE_SPECULATIVE_CONFIG", '{"method": "mtp", "num_speculative_tokens": 2}')
    llm = make_llm(demo_dir)
    assert llm.config.speculative_config == SpeculativeConfig("mtp", 2)
    assert llm.engine.num_speculative_tokens == 2 and llm.engine.async_scheduling
    assert llm.cache.pools["mtp_layers"]  # the drafter's window lives in the paged cache


def test_cli_option_reaches_the_engine():
    from deepserve.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "dspark"}'])
    assert engine_options(args)["speculative_config"] == SpeculativeConfig("dspark", 5)
    bad = build_parser().parse_args(["serve", "--speculative-config", '{"method": "mtp", "n": 1}'])
    with pytest.raises(ValueError, match="unknown field"):
        engine_options(bad)


async def test_metrics_export_draft_counts_and_acceptance_by_position(aiohttp_client):
    from prometheus_client.parser import text_string_to_metric_families

    from deepserve.core.plugins import make_plugin_manager
    from deepserve.server import ServerConfig, create_app

    engine = dict(dtype="float32", accelerator="cpu", max_model_len=512, max_num_seqs=4, block_size=128,
                  speculative_config=SPEC)
    config = ServerConfig(model=str(EMBEDDED), served_model_name="tiny", engine_kwargs=engine)
    client = await aiohttp_client(create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False)))
    for prompt in ("def add(a, b):", "import os\nimport sys\n"):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                        "temperature": 0})
        assert r.status == 200
    text = await (await client.get("/metrics")).text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    value = lambda name, **labels: samples[(name, tuple(sorted(labels.items())))]  # noqa: E731
    steps = value("deepserve_spec_decode_sequence_steps_total")
    verified, accepted = (value("deepserve_spec_decode_verified_tokens_total"),
                          value("deepserve_spec_decode_accepted_tokens_total"))
    assert steps > 0 and 0 < accepted <= verified <= value("deepserve_spec_decode_draft_tokens_total")
    assert 0 <= value("deepserve_spec_decode_forced_draft_tokens_total") <= value("deepserve_spec_decode_draft_tokens_total")
    assert value("deepserve_spec_decode_accepted_tokens_per_step") == pytest.approx(accepted / steps)
    assert value("deepserve_spec_decode_verified_tokens_per_step") == pytest.approx(verified / steps)
    first = value("deepserve_spec_decode_acceptance_rate", position="1")
    assert 0 < first <= 1
    assert sum(value("deepserve_spec_decode_accepted_tokens_by_position_total", position=str(j))
               for j in range(1, 6)) == accepted
    # 2 requests x 24 tokens: one per step each, plus the accepted drafts
    assert value("deepserve_generation_tokens_total") == 48


def test_constrained_requests_draft_and_keep_their_greedy_tokens(embedded_pair):
    """Grammar-constrained requests draft too: each verified position is masked (`fill_draft_masks`), so the
    tokens are the non-speculative constrained ones."""
    plain, spec = embedded_pair
    constraints = [{"regex": r"(import [a-z]+\n){4,6}"}, {"choice": ["import os", "import sys", "from x import y"]},
                   {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                             "required": ["name"]}}]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in constraints]
    prompts = ["import os\nimport re\n", "# pick one\n", '{"name": "json"}\n']
    ref = plain.generate(prompts, params, use_tqdm=False)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.num_verified_tokens for o in outs) > 0 and sum(o.num_accepted_tokens for o in outs) > 0
    assert_everything_free(spec)
