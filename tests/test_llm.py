"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, against the oracle and itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.model.loader import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", accelerator="cpu")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=0)


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 40, 90, 17, 1)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_generation_equals_each_alone(llm):
    together = ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
    alone = [ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=10, ignore_eos=True)
    p = prompts()[1]
    alone = ids(llm.generate([p], params, use_tqdm=False))[0]
    busy = ids(llm.generate(prompts()[:1] + [p] + prompts()[2:], [GREEDY, params, GREEDY, GREEDY, GREEDY],
                            use_tqdm=False))[1]
    assert alone == busy
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=43, max_tokens=10, ignore_eos=True)
    assert ids(llm.generate([p], other_seed, use_tqdm=False))[0] != alone


def test_chunked_prefill_budget_does_not_change_results(tiny_dir, llm):
    small = LLM(tiny_dir, dtype="float32", accelerator="cpu", max_num_batched_tokens=7, max_num_seqs=2)
    assert ids(small.generate(prompts(), GREEDY, use_tqdm=False)) == ids(llm.generate(prompts(), GREEDY, use_tqdm=False))


@torch.no_grad()
def test_greedy_tokens_and_prompt_logprobs_match_transformers(llm, hf_tiny):
    p = prompts()[2]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                               prompt_logprobs=2, logprobs=3), use_tqdm=False)[0]
    ref = torch.log_softmax(hf_tiny(torch.tensor([p])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        entry = out.prompt_logprobs[i]
        assert p[i] in entry and len(entry) <= 3
        assert abs(entry[p[i]].logprob - ref[i - 1, p[i]].item()) < 1e-4
        assert entry[p[i]].rank == 1 + int((ref[i - 1] > ref[i - 1, p[i]]).sum())
    gen = hf_tiny.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None,
                           output_scores=True, return_dict_in_generate=True)
    tokens = out.outputs[0].token_ids
    for step, score in enumerate(gen.scores):
        top2 = score[0].topk(2).values
        if (top2[0] - top2[1]).item() < 1e-3:
            break
        assert tokens[step] == gen.sequences[0, len(p) + step].item()
    # each generated token carries its own logprob (rank 1 under greedy) plus the top-3
    for token, entry in zip(tokens, out.outputs[0].logprobs):
        assert token in entry and entry[token].rank == 1 and 3 <= len(entry) <= 4
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(tokens, out.outputs[0].logprobs)))


def test_stop_token_ids_eos_and_min_tokens(llm):
    p = prompts()[1]
    free = ids(llm.generate([p], GREEDY, use_tqdm=False))[0]
    stop_at = free[4]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    first = free.index(stop_at)
    assert out.outputs[0].token_ids == free[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    blocked = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_at]),
                           use_tqdm=False)[0]
    assert stop_at not in blocked.outputs[0].token_ids and blocked.outputs[0].finish_reason == "length"


def test_text_prompts_stop_strings_and_detokenization(demo_dir):
    llm = LLM(demo_dir, accelerator="cpu")
    free = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert free.prompt == "def f(x):" and free.prompt_token_ids == llm.tokenizer.encode("def f(x):")
    assert text == llm.tokenizer.decode(free.outputs[0].token_ids)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty"), ([5, 512], "outside the vocabulary"), ([5, -1], "outside the vocabulary"),
     ({"prompt": "x"}, "prompt_token_ids"), ("text", "no tokenizer.json")],
)
def test_bad_prompts_are_named(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_prompt_longer_than_the_context(tiny_dir):
    short = LLM(tiny_dir, dtype="float32", accelerator="cpu", max_model_len=32)
    with pytest.raises(ValueError, match="40 tokens but max_model_len is 32"):
        short.generate([prompts()[1]], GREEDY, use_tqdm=False)
    out = short.generate([prompts()[0]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 32 - 3 and out[0].outputs[0].finish_reason == "length"


def test_model_location_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSERVE_MODEL", raising=False)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.setattr("deepserve.build.default_model_dir", lambda: None)  # as if the embedded model were absent
    with pytest.raises(ValueError, match="no model given"):
        LLM()
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(tmp_path / "nowhere", accelerator="cpu")


def test_deepinfer_environment_names_are_honoured(tiny_dir, monkeypatch):
    monkeypatch.delenv("DEEPSERVE_MODEL", raising=False)
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tiny_dir))
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    llm = LLM(dtype="float32")
    assert llm.backend.name == "cpu" and len(llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


def test_bfloat16_runs(tiny_dir):
    llm = LLM(tiny_dir, dtype="bfloat16", accelerator="cpu")
    assert llm.model.lm_head.weight.dtype == torch.bfloat16
    assert llm.model.model.layers[0].attn_hc.fn.dtype == torch.float32
    out = llm.generate(prompts()[:2], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_offline_example_runs_end_to_end(tiny_dir, demo_dir):
    env = {**os.environ, "DEEPSERVE_MODEL": str(demo_dir), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "offline_inference.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("->") == 8 and "=== greedy ===" in res.stdout


def test_prompt_logprobs_cover_a_prompt_the_prefix_cache_holds(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=128, kv_cache_bytes=2**24)
    prompt = [(7 * i) % 400 + 2 for i in range(300)]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    wants = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                         use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 256  # the blocks stay shared
    assert wants.num_cached_tokens == 0  # computed whole, so that every position has its logprobs
    assert len(wants.prompt_logprobs) == len(prompt) and all(p is not None for p in wants.prompt_logprobs[1:])
    assert wants.outputs[0].token_ids == first.outputs[0].token_ids
