"""V4.1 through the engine: `LLM(model=<V4.1 dir>)` builds the V4.1 runner; chunked prefill computes what one
prefill does; continuous batching, greedy generation and prefix hits give the contiguous model's own greedy
tokens, also through the server and after a preemption; image tokens and options the V4.1 path lacks are refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deepserve import LLM
from deepserve.core.sampling_params import SamplingParams
from deepserve.model.v41 import load_v41
from deepserve.model.v41.runner import V41ModelRunner

GOLDEN = Path(__file__).parent / "golden" / "v41"
TINY_A, TINY_B = GOLDEN / "tiny_a" / "tiny", GOLDEN / "tiny_b" / "tiny"


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(model, ids: list[int], n: int) -> list[int]:
    """The contiguous model's own greedy decode: one prefill, then one-token steps."""
    state, out = model.make_state(), []
    logits = model.forward(ids, state).logits
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward([out[-1]], state).logits
    return out


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(model=str(TINY_A), max_num_seqs=4, max_num_batched_tokens=24, block_size=128)


@pytest.mark.parametrize("tiny", [TINY_A, TINY_B])
def test_a_prompt_in_chunks_computes_one_prefill_bit_for_bit(tiny):
    """Chunks at any position (one-token chunks at open ratio-2 groups included: prompt=True reads the index
    keys one prefill reads), cut at random places and into one-token pieces: every logit equals one prefill's."""
    torch.set_num_threads(1)
    model = load_v41(tiny)
    rng = random.Random(str(tiny))
    n = 48  # past both windows
    ids = prompt(n, seed=3)
    whole = model.forward(ids, model.make_state(), all_logits=True).logits
    cuttings = [sorted(rng.sample(range(1, n), rng.randint(1, 6))) for _ in range(3)] + [list(range(1, n))]
    for cuts in cuttings:
        state, parts = model.make_state(), []
        for a, b in zip([0] + cuts, cuts + [n]):
            parts.append(model.forward(ids[a:b], state, all_logits=True, prompt=True).logits.view(b - a, -1))
        assert torch.equal(torch.cat(parts), whole), cuts
    assert state.layers[2].rows.shape[0] == len(ids) // 2  # the ratio-2 source closed every group


def test_generate_batches_sequences_and_equals_the_models_greedy(llm):
    assert isinstance(llm.runner, V41ModelRunner)
    prompts = [prompt(n, seed) for seed, n in enumerate((5, 23, 50))]  # 50 > 24: prefilled in chunks
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.stats.num_steps < 3 * 6  # the sequences decoded together
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == greedy(llm.model, p, 6)


def test_a_prefix_hit_gives_the_cold_runs_tokens(llm):
    shared = prompt(130, seed=7)  # one full page of 128 tokens
    a, b = shared + prompt(6, seed=8), shared + prompt(9, seed=9)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.kv_manager.num_prefix_hits
    out_a = llm.generate([a], sp, use_tqdm=False)[0]
    out_b = llm.generate([b], sp, use_tqdm=False)[0]
    assert llm.kv_manager.num_prefix_hits - before == 128  # b started from a's page-boundary snapshot
    assert list(out_a.outputs[0].token_ids) == greedy(llm.model, a, 4)
    assert list(out_b.outputs[0].token_ids) == greedy(llm.model, b, 4)


def test_a_preempted_request_recomputes_its_own_tokens():
    """Three pages for two sequences that each cross a page: one is preempted and recomputed, its generated
    tokens as the decode steps that made them, so the tokens are still the model's greedy ones."""
    from deepserve.model.v41.paged import bytes_per_page

    model = load_v41(TINY_A)
    llm = LLM(model=str(TINY_A), block_size=128, max_num_seqs=2, enable_prefix_caching=False,
              kv_cache_bytes=3 * bytes_per_page(model.state_owners(), 128))
    prompts = [prompt(120, seed) for seed in (0, 1)]  # without the decode replay, the second one diverges
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions >= 1
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == greedy(model, p, 12)


def test_text_prompts_use_the_checkpoints_tokenizer(llm):
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    ids = llm.tokenizer.encode("hello world")
    assert list(out.prompt_token_ids) == ids
    assert list(out.outputs[0].token_ids) == greedy(llm.model, ids, 3)
    assert out.outputs[0].text == llm.tokenizer.decode(list(out.outputs[0].token_ids))


def test_image_tokens_and_missing_options_are_refused(llm):
    llm.engine.image_token_id = 7  # tiny_a's own image token lies outside its vocabulary
    try:
        with pytest.raises(ValueError, match="image token 7.*vision-encoder role"):
            llm.engine.add_request("img", [3, 7, 4], SamplingParams(max_tokens=1))
    finally:
        llm.engine.image_token_id = llm.model.cfg.image_token_id
    with pytest.raises(ValueError, match="does not take data_parallel_size / enable_expert_parallel yet"):
        LLM(model=str(TINY_A), block_size=128, data_parallel_size=2)


async def test_the_server_serves_it(aiohttp_client):
    from deepserve.core.plugins import make_plugin_manager
    from deepserve.model.tokenizer import Tokenizer
    from deepserve.server import ServerConfig, create_app

    torch.set_num_threads(1)
    engine = {"block_size": 128, "max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20}
    config = ServerConfig(model=str(TINY_A), served_model_name="v41", engine_kwargs=engine)
    client = await aiohttp_client(create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False)))
    ids = prompt(12, seed=5)
    r = await client.post("/v1/completions", json={"model": "v41", "prompt": ids, "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True})
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body["choices"][0]["text"] == Tokenizer(TINY_A).decode(greedy(load_v41(TINY_A), ids, 4))
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (12, 4)
