"""Logits processing before sampling (`deepserve.model.logits_processors`): bad words, logit_bias and the
presence, frequency and repetition penalties, by hand on small logits and through the engine on the tiny model."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.core.interfaces import PLACEHOLDER, ChunkInput
from deepserve.model.logits_processors import process_logits


def chunk(params: SamplingParams, output=(), prompt=(), token_ids=(5,), rid="r") -> ChunkInput:
    return ChunkInput(rid, 10, tuple(token_ids), True, (0,), params, 0, output_token_ids=tuple(output),
                      prompt_token_ids=tuple(prompt))


def run(logits, chunks, batch_ids=(), offsets=None):
    offsets = offsets if offsets is not None else [0] * len(chunks)
    return process_logits(logits.clone(), chunks, torch.tensor(batch_ids or [0], dtype=torch.long), offsets)


def test_rows_without_options_are_returned_untouched():
    logits = torch.randn(3, 8)
    chunks = [chunk(SamplingParams()), chunk(SamplingParams(temperature=0))]
    same = logits[:2]
    assert process_logits(same, chunks, torch.zeros(1, dtype=torch.long), [0, 0]) is same


def test_logit_bias_adds_to_its_tokens_only():
    logits = torch.zeros(2, 6)
    out = run(logits, [chunk(SamplingParams(logit_bias={"2": 5.5, 4: -100})), chunk(SamplingParams())])
    assert out[0].tolist() == [0, 0, 5.5, 0, -100, 0]
    assert out[1].tolist() == [0] * 6


def test_presence_and_frequency_count_the_output_including_the_pending_token():
    logits = torch.ones(1, 6)
    # output so far: 1, 1, 3 known, then a placeholder whose token (3) the batch holds at position 7
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    c = chunk(params, output=(1, 1, 3), token_ids=(PLACEHOLDER,))
    out = run(logits, [c], batch_ids=[0] * 7 + [3], offsets=[7])
    assert out[0].tolist() == pytest.approx([1, 1 - 0.5 - 0.5, 1, 1 - 0.5 - 0.5, 1, 1])


def test_repetition_penalty_scales_prompt_and_output_tokens_by_sign():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0]])
    c = chunk(SamplingParams(repetition_penalty=2.0), output=(0,), prompt=(1, 3))
    out = run(logits, [c])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -4.0, 2.0]


def test_bad_words_ban_a_single_token_always_and_a_longer_word_after_its_prefix():
    logits = torch.zeros(3, 6)
    words = [[4], [1, 2, 3]]
    ends_with_prefix = chunk(SamplingParams(bad_words_token_ids=words), output=(0, 1), token_ids=(PLACEHOLDER,))
    other_prefix = chunk(SamplingParams(bad_words_token_ids=words), output=(2, 1), token_ids=(PLACEHOLDER,))
    too_short = chunk(SamplingParams(bad_words_token_ids=words), output=(), token_ids=(5,))
    # the placeholders are token 2: row 0's output ends 1, 2 (banning 3), row 1's ends 1, 2 too
    out = run(logits, [ends_with_prefix, other_prefix, too_short], batch_ids=[2, 2, 5], offsets=[0, 1, 2])
    inf = float("-inf")
    assert out[0].tolist() == [0, 0, 0, inf, inf, 0]
    assert out[1].tolist() == [0, 0, 0, inf, inf, 0]
    assert out[2].tolist() == [0, 0, 0, 0, inf, 0]
    out = run(logits[:1], [chunk(SamplingParams(bad_words_token_ids=words), output=(1, 0), token_ids=(2,))])
    assert out[0].tolist() == [0, 0, 0, 0, inf, 0]  # the output ends 1, 0 (the chunk's 2 is not an output)


def test_a_row_is_processed_alike_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(0)
    vocab = 97
    params = [SamplingParams(presence_penalty=0.3, frequency_penalty=-0.7, repetition_penalty=1.3,
                             logit_bias={3: 2.0}, bad_words_token_ids=[[5], [7, 8]]),
              SamplingParams(),
              SamplingParams(frequency_penalty=1.1),
              SamplingParams(repetition_penalty=0.8, logit_bias={90: -1.0})]
    chunks = [chunk(p, output=torch.randint(0, vocab, (4 + 3 * i,), generator=g).tolist(),
                    prompt=torch.randint(0, vocab, (9,), generator=g).tolist(), rid=f"r{i}")
              for i, p in enumerate(params)]
    logits = torch.randn(len(chunks), vocab, generator=g)
    batched = run(logits, chunks)
    for i in range(len(chunks)):
        assert torch.equal(run(logits[i : i + 1], [chunks[i]])[0], batched[i])
    order = [2, 0, 3, 1]
    permuted = run(logits[order], [chunks[i] for i in order])
    assert torch.equal(permuted, batched[order])


def test_sampling_params_validate_the_new_fields():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(logit_bias={"x": 1}), dict(logit_bias={1: 101}), dict(logit_bias=[1]),
                dict(bad_words=[""]), dict(bad_words_token_ids=[[]])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert not SamplingParams().uses_logits_processors
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}
    params = SamplingParams(bad_words=["ab"])
    params.update_from_tokenizer(lambda text: [ord(ch) for ch in text])
    assert params.bad_words_token_ids == [[97, 98], [32, 97, 98]]
    assert params.reads_output_history and not SamplingParams(logit_bias={1: 1}).reads_output_history


# -- through the engine, on the embedded model ---------------------------------------------------------------------

PROMPT = list(range(40, 72))


@pytest.fixture(scope="module")
def embedded():
    from pathlib import Path

    import deepserve

    path = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
    return LLM(path, dtype="float32", accelerator="cpu", load_plugins=False, block_size=128)


def generate(llm, params, prompts=(PROMPT,)):
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_logit_bias_forces_and_forbids_tokens(embedded):
    plain = generate(embedded, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    forced = generate(embedded, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               logit_bias={777: 100}))[0]
    assert forced == [777] * 6
    banned = generate(embedded, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                               logit_bias={t: -100 for t in plain}))[0]
    assert not set(banned) & set(plain)


def test_penalties_change_greedy_repeats_and_bad_words_hold(embedded):
    plain = generate(embedded, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(set(plain)) < len(plain)  # the greedy output repeats itself
    distinct = generate(embedded, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 presence_penalty=2.0, repetition_penalty=2.0))[0]
    assert len(set(distinct)) > len(set(plain))
    pair = plain[2:4]
    avoided = generate(embedded, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                bad_words_token_ids=[pair]))[0]
    first = plain.index(pair[0])  # nothing changes before the word's prefix first appears
    assert avoided[: first + 1] == plain[: first + 1]
    assert all(avoided[i : i + 2] != pair for i in range(len(avoided) - 1))


def test_penalized_sampling_is_seeded_and_batch_and_schedule_invariant(embedded, tmp_path):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=-0.5, repetition_penalty=1.2, logit_bias={100: 3.0},
                            bad_words_token_ids=[[200, 201], [9]])
    alone = generate(embedded, params)[0]
    others = [SamplingParams(temperature=0.9, seed=i, max_tokens=9 + i, ignore_eos=True) for i in range(3)]
    batched = embedded.generate([{"prompt_token_ids": PROMPT}] + [{"prompt_token_ids": PROMPT[i:]} for i in range(3)],
                                [params] + others, use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone
    assert generate(embedded, params)[0] == alone
    assert 9 not in alone
    from pathlib import Path

    import deepserve

    sync = LLM(Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4", dtype="float32", accelerator="cpu",
               load_plugins=False, block_size=128, async_scheduling=False)
    assert generate(sync, params)[0] == alone  # the pending token is counted whether or not it is a placeholder


def test_the_engine_refuses_untokenized_bad_words(embedded):
    with pytest.raises(ValueError, match="update_from_tokenizer"):
        embedded.engine.add_request("x", PROMPT, SamplingParams(bad_words=["hello"]))
