"""The start-up warm-up (`deepserve.model.warm_up`): it runs every kind of step through the real runner, leaves
nothing behind, and changes no output. Forced on the CPU reference backend (`warm_up=True`), where it is off by
default."""

from __future__ import annotations

import os
import random

import pytest

from deepserve import LLM, SamplingParams
from deepserve.model import runner as runner_mod
from deepserve.model.warm_up import chunk_lengths, wanted

BUDGET = 160  # max_num_batched_tokens: prompt chunks up to it, and more than a 128-token page
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo-warm-up"), seed=5)


def make_llm(path, **kw):
    return LLM(path, dtype="float32", accelerator="cpu", load_plugins=False, block_size=128, max_num_seqs=4,
               max_num_batched_tokens=BUDGET, **kw)


def classify(steps) -> tuple[dict[str, int], list[int], set[int]]:
    """The kinds of the runner steps `steps` (what the spy saw), counted; the lengths of their new sequences'
    prompt chunks (starting at token 0); the batch sizes of their decode steps."""
    held, kinds, lengths = set(), dict.fromkeys(("prompt", "prefix", "prefix_hit", "mixed", "decode", "verify"), 0), []
    batches = set()
    for step in steps:
        held -= set(step.freed_request_ids)
        rows = prompts = 0
        for c in step.chunks:
            if c.num_draft_tokens:
                kinds["verify"] += 1
            if c.request_id in held and (len(c.token_ids) == 1 or c.num_draft_tokens):
                rows += 1
                continue
            prompts += 1
            if c.start == 0:
                kinds["prompt"] += 1
                lengths.append(len(c.token_ids))
            else:
                kinds["prefix" if c.request_id in held else "prefix_hit"] += 1
        held |= {c.request_id for c in step.chunks}
        kinds["mixed"] += bool(rows >= 2 and prompts)  # (two decode rows: the runner splits them off)
        kinds["decode"] += bool(rows and not prompts)
        if rows and not prompts:
            batches.add(rows)
    return kinds, lengths, batches


def workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampled requests, some with logprobs, two sharing a two-page prefix (a prefix hit), of
    lengths that span several chunks."""
    rng = random.Random(7)
    shared = [rng.randrange(2, vocab) for _ in range(256)]
    out = []
    for i in range(7):
        prompt = (shared if i in (2, 5) else []) + [rng.randrange(2, vocab) for _ in range(rng.randint(1, 300))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 20), ignore_eos=True,
                                logprobs=2 if i == 3 else None) if i % 2 == 0 else \
            SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=rng.randint(4, 20), ignore_eos=True)
        out.append((prompt, params))
    return out


def run(llm, items):
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in items], [sp for _, sp in items], use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs or []]) for o in outs]


def assert_as_built(llm):
    """Nothing of the warm-up is left: every page and slot free, no prefix-cache entry, nothing counted."""
    kv = llm.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks and kv.pool.num_cached_blocks == 0 and not kv.block_tables
    assert llm.runner.num_active_sequences == 0 and llm.cache.num_free_slots == llm.cache.num_slots
    assert llm.runner.speculation is None or llm.runner.speculation.num_requests_held == 0
    snap = llm.engine.snapshot()
    assert (snap.num_requests_running, snap.num_requests_waiting, snap.num_kv_pages_used, snap.num_steps,
            snap.num_prompt_tokens, snap.num_generation_tokens, snap.num_prefix_queries, snap.num_prefix_hits) == \
        (0,) * 8
    assert snap.spec is None or (snap.spec.num_seq_steps, snap.spec.num_draft_tokens, snap.spec.num_verified_tokens,
                                 snap.spec.num_accepted_tokens) == (0, 0, 0, 0)
    assert llm.cost_model.num_observations == 0  # the step-cost fit never saw a warm-up step


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "mtp"])
def test_warm_up_runs_every_step_kind_leaves_nothing_and_changes_no_output(demo_dir, monkeypatch, spec):
    cold = make_llm(demo_dir, speculative_config=spec)
    assert cold.runner.warm_up_report is None  # off by default on the CPU
    seen = []
    execute = runner_mod.ModelRunner.execute
    monkeypatch.setattr(runner_mod.ModelRunner, "execute", lambda self, step: seen.append(step) or execute(self, step))
    warm = make_llm(demo_dir, speculative_config=spec, warm_up=True)
    monkeypatch.undo()

    kinds, lengths, batches = classify(seen)
    assert kinds["prompt"] and kinds["prefix"] and kinds["prefix_hit"] and kinds["mixed"] and kinds["decode"]
    assert bool(kinds["verify"]) == (spec is not None)
    # a 1-token chunk, the budget, and lengths of each Triton class: 1, divisible by 16 and not
    assert 1 in lengths and BUDGET in lengths and set(chunk_lengths(BUDGET)) <= set(lengths)
    assert all(sum(len(c.token_ids) for c in s.chunks) <= BUDGET for s in seen)
    assert batches == {1, 2, 3, 4}  # decode (verify) steps of every batch size: no CUDA graph takes them here
    report = warm.runner.warm_up_report
    assert sum(report.steps.values()) == sum(1 for s in seen if s.chunks)
    assert_as_built(warm)

    items = workload(warm.model.cfg.vocab_size)
    assert run(warm, items) == run(cold, items)  # bit-identical tokens and logprobs
    assert warm.engine.snapshot().num_prefix_hits > 0  # (the workload's shared prefix hit)


def test_chunk_lengths_meet_every_kernel_variant_a_step_size_picks():
    """Every class of step size the NVIDIA kernels tell apart (Triton's == 1 and divisible-by-16
    specializations; the MoE's rows per block, one-program alignment and DeepGEMM by (token, expert) pairs, the FP4
    experts' rows per block by pairs per expert and their one block a pair; `gemv` and the FP8 GEMV by rows) that a
    budget reaches, a warm-up length reaches, at V4's top-6 of 256 experts and others."""
    from deepserve.backends.nvidia.backend import DEEP_GEMM_MIN_PAIRS
    from deepserve.backends.nvidia.triton_ops import fp4_moe, fp8_linear, gemv, moe

    def variant(tokens: int, top_k: int, experts: int) -> tuple:
        pairs = tokens * top_k
        return (tokens == 1, tokens % 16 == 0, moe._block_m(pairs), pairs <= moe.SMALL_ALIGN_PAIRS,
                pairs >= DEEP_GEMM_MIN_PAIRS, tokens <= gemv.MAX_ROWS, tokens <= fp8_linear.GEMV_ROWS,
                fp4_moe._fp4_block_m(pairs, experts), pairs <= fp4_moe.PAIR_GEMV_PAIRS)

    for top_k, experts in ((1, 8), (2, 16), (6, 16), (6, 256), (8, 384), (16, 64)):
        for budget in (1, 2, 17, 100, 511, 2731, 3000, 8192, 16384, 20000):
            lengths = chunk_lengths(budget)
            assert max(lengths) == budget and min(lengths) == 1
            assert {variant(n, top_k, experts) for n in lengths} == \
                {variant(n, top_k, experts) for n in range(1, budget + 1)}, (top_k, experts, budget)


def test_the_option_and_its_default():
    from deepserve.cli import build_parser, engine_options
    from deepserve.core.config import EngineConfig

    assert not wanted(None, "cpu") and wanted(None, "cuda:0") and not wanted(False, "cuda:0") and wanted(True, "cpu")
    with pytest.raises(ValueError, match="warm_up"):
        EngineConfig(warm_up="yes")
    for flag in ("--skip-warm-up", "--skip-server-warmup"):
        assert engine_options(build_parser().parse_args(["serve", flag]))["warm_up"] is False
    assert "warm_up" not in engine_options(build_parser().parse_args(["serve"]))


def test_compiled_kernels_persist_under_the_cache_directory(tmp_path, monkeypatch):
    """A restart compiles nothing: Triton's and DeepGEMM's JIT caches go under DEEPSERVE_CACHE_DIR, unless the user
    named their own."""
    from deepserve.backends.nvidia.backend import persist_compiled_kernels

    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("DG_JIT_CACHE_DIR", "/users/own/dg")
    persist_compiled_kernels()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["DG_JIT_CACHE_DIR"] == "/users/own/dg"
    monkeypatch.delenv("DG_JIT_CACHE_DIR")
    persist_compiled_kernels()
    assert os.environ["DG_JIT_CACHE_DIR"] == str(tmp_path / "deep_gemm")
