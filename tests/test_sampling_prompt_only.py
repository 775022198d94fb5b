"""`max_tokens=0` (issue 25): the engine computes the prompt, for its logprobs, and samples nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

import deepserve
from deepserve import LLM, SamplingParams

PROMPT = list(range(40, 300))  # three pages of 128: chunked over steps with max_num_batched_tokens=128


@pytest.fixture(scope="module")
def llm():
    path = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
    return LLM(path, dtype="float32", accelerator="cpu", load_plugins=False, block_size=128,
               max_num_batched_tokens=128)


def test_max_tokens_0_returns_the_prompt_logprobs_and_no_token(llm):
    only, sampled = llm.generate([{"prompt_token_ids": PROMPT}] * 2,
                                 [SamplingParams(max_tokens=0, prompt_logprobs=1),
                                  SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)], use_tqdm=False)
    out = only.outputs[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert len(only.prompt_logprobs) == len(PROMPT)
    assert [p and {t: lp.logprob for t, lp in p.items()} for p in only.prompt_logprobs] == \
        [p and {t: lp.logprob for t, lp in p.items()} for p in sampled.prompt_logprobs]
    assert llm.engine.stats.num_generation_tokens >= 1  # only the second request generated
    assert not llm.engine.has_unfinished_requests()
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.pool.num_blocks or llm.engine.enable_prefix_caching


def test_max_tokens_0_beside_decoding_requests(llm):
    outs = llm.generate([{"prompt_token_ids": PROMPT[:50]}, {"prompt_token_ids": PROMPT[10:90]}],
                        [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), SamplingParams(max_tokens=0)],
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 5 and outs[1].outputs[0].token_ids == []
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)
