"""What keeps the engine's host time per step independent of prompt and output lengths: a request's tokens read
through a view (`TokenIds`) instead of joined lists, one prompt list shared by a request's snapshots, final-only
reporting for callers that read only the end (`LLM.generate`), and snapshots holding views of the output
(`Prefix`) for streams (the server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve import LLM, SamplingParams
from deepserve.core.outputs import Prefix
from deepserve.core.request import Request, TokenIds


def test_token_ids_reads_like_the_joined_list():
    prompt, output = [10, 11, 12, 13], [20, 21, 22]
    view, joined = TokenIds(prompt, output), prompt + output
    assert len(view) == len(joined) and list(view) == joined
    for i in range(-len(joined), len(joined)):
        assert view[i] == joined[i]
    for start in range(-8, 9):
        for stop in range(-8, 9):
            assert view[start:stop] == joined[start:stop], (start, stop)
    assert view[::2] == joined[::2] and view[::-1] == joined[::-1]
    with pytest.raises(IndexError):
        view[7]
    with pytest.raises(IndexError):
        view[-8]
    output.append(23)  # a view, not a copy: the request's new tokens show
    assert view[-1] == 23 and len(view) == 8


def test_a_request_s_tokens_are_a_view_of_its_lists():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    tokens = request.all_token_ids
    request.output_token_ids.append(9)
    assert list(tokens) == [1, 2, 3, 9] and tokens[2:4] == [3, 9]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=128)


def run(engine, final_only: bool):
    """Two requests to the end; every output `step()` returned, per request."""
    prompts = [[5 + i % 300 for i in range(200)], [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{final_only}", prompt, params, final_only=final_only)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id.split("-")[0], []).append(out)
    return seen


def test_final_only_reports_each_request_once_with_the_same_end(llm):
    streamed, final = run(llm.engine, False), run(llm.engine, True)
    for rid in ("r0", "r1"):
        assert len(streamed[rid]) > 1 and [o.finished for o in final[rid]] == [True]
        a, b = streamed[rid][-1], final[rid][0]
        assert a.finished and a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text and a.prompt_token_ids == b.prompt_token_ids


def test_snapshots_share_the_prompt_list_and_keep_their_tokens(llm):
    snapshots = run(llm.engine, False)["r0"]
    assert all(s.prompt_token_ids is snapshots[0].prompt_token_ids for s in snapshots)
    assert snapshots[0].prompt_token_ids == [5 + i % 300 for i in range(200)]
    lengths = [len(s.outputs[0].token_ids) for s in snapshots]
    assert lengths == sorted(lengths) and lengths[-1] == 6  # each snapshot kept the tokens it had


# -- streamed snapshots as views (`EngineCore.add_request(views=True)`, what the server streams with) --------------
def test_prefix_reads_like_the_copy_it_replaces():
    items = [3, 1, 4, 1, 5, 9]
    view, copy = Prefix(items, 4), items[:4]
    assert len(view) == 4 and list(view) == copy and view == copy and view == tuple(copy) and repr(view) == repr(copy)
    for i in range(-4, 4):
        assert view[i] == copy[i]
    for start in range(-6, 7):
        for stop in range(-6, 7):
            assert view[start:stop] == copy[start:stop], (start, stop)
    assert view[::-1] == copy[::-1] and isinstance(view[1:], list)
    for bad in (4, -5):
        with pytest.raises(IndexError):
            view[bad]
    items.append(2)
    del items[5:]  # what the engine may do: grow, or cut past what a snapshot shows
    assert view == copy and view != items and view != Prefix(items, 3)
    with pytest.raises(TypeError):
        hash(view)
    with pytest.raises(ValueError):
        Prefix(items, 9)


def test_view_snapshots_equal_copies_and_keep_their_content(llm):
    """Two identical greedy requests with logprobs, one streamed as views: every step's outputs read the same,
    earlier view snapshots still read what they did when the request has gone on, and the final output holds
    plain lists."""
    engine = llm.engine
    prompt = [5 + i % 300 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine.add_request("copies", prompt, params)
    engine.add_request("views", prompt, params, views=True)
    steps = []
    while engine.has_unfinished_requests():
        outs = {o.request_id: o for o in engine.step()}
        if outs:
            steps.append((outs["copies"], outs["views"],
                          [list(outs["views"].outputs[0].token_ids), list(outs["views"].outputs[0].logprobs)]))
    assert len(steps) > 2
    for copied, viewed, at_the_time in steps:
        a, b = copied.outputs[0], viewed.outputs[0]
        assert b.token_ids == a.token_ids == at_the_time[0] and b.logprobs == a.logprobs == at_the_time[1]
        assert b.text == a.text and b.cumulative_logprob == a.cumulative_logprob
        assert isinstance(b.token_ids, Prefix) != viewed.finished  # views while running, lists at the end
    final = steps[-1][1].outputs[0]
    assert type(final.token_ids) is list and type(final.logprobs) is list and len(final.token_ids) == 12


def test_final_only_text_is_decoded_once_and_equals_the_streamed_text():
    """A final-only request without stop strings is detokenized once, when it finishes (not two decodes a token
    every step), to the text the streamed deltas join to: over random ids with raw bytes that break UTF-8
    characters (a held-back tail: kept when the request ends by length, dropped when EOS ends it), special ids,
    several tokens a step (kept drafts), and the decode-once path's fallback."""
    import random

    from deepserve.core.config import ModelConfig
    from deepserve.core.engine import EngineCore
    from deepserve.core.interfaces import ModelExecutor, StepOutput
    from deepserve.core.kv.manager import KVCacheManager
    from deepserve.core.scheduler.cost_model import CostModelConfig, StepCostModel
    from deepserve.core.scheduler.scheduler import Scheduler
    from deepserve.core.tracking import RequestTracker
    from deepserve.core.env import default_model_dir
    from deepserve.model.tokenizer import IncrementalDetokenizer, Tokenizer, _byte_chars

    model_dir = Path(default_model_dir())
    cfg = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    tokenizer = Tokenizer(model_dir, cfg)
    eos = cfg.eos_token_ids[0]
    lead_byte = tokenizer.token_to_id(_byte_chars()[0xE2])  # the first byte of a three-byte UTF-8 character

    class Scripted(ModelExecutor):
        """Each request's next id from its script (request ids name the script)."""

        num_free_slots, num_active_sequences = 64, 0

        def __init__(self, scripts):
            self.scripts, self.at = scripts, {}

        def execute(self, step):
            out = StepOutput()
            for c in step.chunks:
                if c.samples:
                    i = self.at.get(c.request_id, 0)
                    self.at[c.request_id] = i + 1
                    out.sampled[c.request_id] = self.scripts[c.request_id][i]
            return out

    rng = random.Random(3)
    scripts = {}
    for i in range(40):
        ids = [rng.choice([rng.randrange(2, 300), rng.randrange(2, cfg.vocab_size)])
               for _ in range(rng.randrange(1, 24))]
        if i % 4 < 2:
            ids[-1] = lead_byte  # the text ends in an unfinished character
        scripts[str(i)] = ids + ([eos] if i % 2 else [])
    texts = {}
    for final_only in (False, True):
        kv = KVCacheManager(256, 128, False)
        scheduler = Scheduler(kv, StepCostModel(CostModelConfig()), 64, 4096, 1024, cfg.eos_token_ids)
        engine = EngineCore(scheduler, Scripted(scripts), page_size=128,
                            make_detokenizer=lambda ids, skip: IncrementalDetokenizer(tokenizer, ids, skip))
        for rid, ids in scripts.items():
            eos_ends = ids[-1] == eos
            engine.add_request(rid, [5, 6, 7], SamplingParams(temperature=0, max_tokens=len(ids),
                                                              ignore_eos=not eos_ends), final_only=final_only)
        deferred = [t.deferred for t in engine._trackers.values()]
        assert all(deferred) == final_only and isinstance(next(iter(engine._trackers.values())), RequestTracker)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    texts.setdefault(final_only, {})[out.request_id] = (out.outputs[0].text,
                                                                        out.outputs[0].finish_reason)
        engine.shutdown()
    assert texts[True] == texts[False]
    assert {reason for _, reason in texts[True].values()} == {"stop", "length"}
    assert any(t.endswith("\ufffd") for t, _ in texts[True].values())  # a tail the length finish flushed
