"""What keeps the engine's host time per step independent of prompt and output lengths: a request's tokens read
through a view (`TokenIds`) instead of joined lists, one prompt list shared by a request's snapshots, and
final-only reporting for callers that read only the end (`LLM.generate`)."""

from __future__ import annotations

import pytest

from deepserve import LLM, SamplingParams
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
