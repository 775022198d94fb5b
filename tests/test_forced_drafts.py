"""Grammar-forced drafts: with speculative decoding, a constrained request whose grammar forces its next tokens (a
JSON schema's keys and punctuation) verifies those tokens as its drafts. They are checked by exact match with the
target's own (masked) sample, so the tokens are plain decoding's, greedy and seeded; and nearly all are kept, so
the structural parts of a JSON answer take one step for several tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import deepserve
from deepserve import LLM, SamplingParams
from deepserve.backends.reference import ReferenceBackend
from deepserve.model.speculative import RowSampling
from deepserve.model.verify import verify

jsonschema = pytest.importorskip("jsonschema")

EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
SPEC = {"method": "mtp", "num_speculative_tokens": 5}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "language", "version", "stable"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "language": {"enum": ["python", "rust"]},
                         "version": {"type": "integer", "minimum": 0, "maximum": 99}, "stable": {"type": "boolean"}}}
PROMPT = '{"name": "deepserve", "language": "python"}\n'


class GrammarDraftsOnly:
    """The MTP proposer with its drafts thrown away (it still catches up): the only drafts left are the tokens the
    grammar forces, so even a sampled request's tokens must be plain decoding's very tokens."""

    def __init__(self, inner) -> None:
        self.inner, self.num_speculative_tokens, self.planner = inner, inner.num_speculative_tokens, None

    def propose(self, streams, chunks, sampling):
        self.inner.propose(streams, chunks, sampling)
        return None


def make_llm(**kw):
    return LLM(EMBEDDED, dtype="float32", accelerator="cpu", load_plugins=False, block_size=128, **kw)


@pytest.fixture(scope="module")
def llms():
    plain = make_llm(async_scheduling=False)
    spec = make_llm(async_scheduling=False, speculative_config=SPEC)
    grammar_only = make_llm(async_scheduling=False, speculative_config=SPEC)
    grammar_only.runner.proposer = GrammarDraftsOnly(grammar_only.runner.proposer)
    return plain, spec, grammar_only


def params(seed=None, schema=SCHEMA):
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=80,
                          structured_outputs={"json": schema})


def run(llm, prompts, sampling):
    """(outputs, sequence-steps the requests took)."""
    before = llm.engine.stats.spec.num_seq_steps
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    return outs, llm.engine.stats.spec.num_seq_steps - before


def test_forced_drafts_keep_greedy_tokens_and_take_several_tokens_per_step(llms):
    plain, spec, _ = llms
    ref = plain.generate([PROMPT], params(), use_tqdm=False)[0]
    forced_before = spec.engine.stats.spec.num_forced_draft_tokens
    (out,), steps = run(spec, [PROMPT], params())
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert spec.engine.stats.spec.num_forced_draft_tokens > forced_before
    # the same request with asynchronous scheduling, where forced drafts never apply (a step for the request is
    # always in flight when its matcher catches up): the MTP drafts alone
    mtp_only = make_llm(speculative_config=SPEC)
    (alone,), mtp_steps = run(mtp_only, [PROMPT], params())
    assert alone.outputs[0].token_ids == ref.outputs[0].token_ids
    assert mtp_only.engine.stats.spec.num_forced_draft_tokens == 0
    assert out.num_accepted_tokens > alone.num_accepted_tokens + len(SCHEMA["required"])
    assert steps < mtp_steps
    assert out.num_accepted_tokens <= out.num_verified_tokens <= out.num_draft_tokens
    stats = spec.engine.stats.spec
    assert stats.num_accepted_tokens <= stats.num_verified_tokens <= stats.num_draft_tokens


@pytest.mark.parametrize("seed", [None, 5, 7, 123])
def test_grammar_drafts_alone_give_plain_decodings_tokens(llms, seed):
    """Greedy and seeded: every forced draft is checked against the target's own sample at its position, so the
    tokens are exactly the non-speculative ones; the structural tokens are kept as drafts."""
    plain, _, grammar_only = llms
    ref = plain.generate([PROMPT], params(seed), use_tqdm=False)[0]
    out = grammar_only.generate([PROMPT], params(seed), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert out.num_verified_tokens == out.num_draft_tokens  # every draft is a forced one, verified
    assert out.num_accepted_tokens >= 2 * len(SCHEMA["required"])  # at least a key and its `":` per field


def test_forced_drafts_in_a_mixed_batch(llms):
    """Constrained requests with forced drafts beside free and MTP-drafting ones: greedy tokens unchanged."""
    plain, spec, _ = llms
    other = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
             "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}
    prompts = [PROMPT, '{"id": 3, "ok": true}\n', "def add(a, b):", PROMPT]
    sampling = [params(), params(schema=other), SamplingParams(temperature=0, max_tokens=24), params(seed=9)]
    ref = plain.generate(prompts, sampling, use_tqdm=False)
    outs = spec.generate(prompts, sampling, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == [o.outputs[0].token_ids for o in ref[:3]]
    jsonschema.validate(json.loads(outs[3].outputs[0].text), SCHEMA)
    assert spec.runner.speculation.num_requests_held == 0 and spec.runner.num_active_sequences == 0


def test_an_exact_draft_is_kept_only_where_the_target_samples_it():
    """`verify` with `exact_rows`: a forced draft the mask leaves a choice against (p(d) = 0.5) is kept exactly
    where the row's own seeded sample is d, and otherwise that sample is the token; a drafter's draft in the same
    batch still goes through the rejection rule."""
    n = 400
    p0 = torch.tensor([0.2, 0.5, 0.3, 0.0])  # the row checking the draft
    bonus = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.stack([p0, bonus]).log().repeat(n, 1)
    draft_ids = torch.tensor([1, 0]).repeat(n)
    exact = torch.tensor([i % 2 == 0 for i in range(n) for _ in range(2)])
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.0, 0.0, 0.0, 0.0]]).repeat(n, 1)
    rows = 2 * n
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    seeds = torch.arange(n).repeat_interleave(2) * 7919 + 3
    sampling = RowSampling(ones, zeros.long(), ones, zeros, seeds)
    positions = torch.tensor([30, 31]).repeat(n)
    backend = ReferenceBackend("cpu")
    kept, token = verify(backend, logits, sampling, positions, [1] * n, draft_ids, q, False, exact)
    plain = backend.sample(logits, ones, zeros.long(), ones, zeros, seeds, positions).view(n, 2)
    first = torch.where(kept == 1, 1, token)
    ex = torch.arange(n) % 2 == 0
    assert torch.equal(first[ex], plain[ex, 0])  # plain decoding's first token
    assert torch.equal(token[ex & (kept == 1)], plain[ex & (kept == 1), 1])  # and its second after a kept draft
    assert 0 < int(kept[ex].sum()) < int(ex.sum())  # both outcomes happen
    assert not torch.equal(first[~ex], plain[~ex, 0])  # the rejection rule's coins are not the sampler's
