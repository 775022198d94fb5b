"""Grammar compiles that overrun their timeout are stopped (their process ended, nothing cached), and one client
cannot hold every compile thread."""

from __future__ import annotations

import pytest

from deepserve.core.grammar_compiler import GrammarBusy, GrammarCompiler
from deepserve.core.structured import GrammarError, GrammarSpec, TokenizerInfo

from fake_grammar import SlowBackend

TOKENIZER = TokenizerInfo('{"model": {"vocab": {}}}', 64, (1,))


def regex(pattern: str) -> GrammarSpec:
    return GrammarSpec("regex", pattern)


@pytest.fixture
def compiler():
    c = GrammarCompiler({"slow": SlowBackend}, TOKENIZER, default_backend="slow", timeout=3.0, max_workers=1)
    yield c
    c.shutdown()


def test_a_compile_past_its_timeout_is_stopped_and_the_next_one_is_served(compiler):
    with pytest.raises(GrammarError, match="grammar compile timeout; it was stopped"):
        compiler.submit(regex("slow+")).result(timeout=60)
    assert compiler._processes["slow"].num_killed == 1
    assert compiler.compile(regex("[0-9]{5}")).compiled == "[0-9]{5}"  # in a new process
    # the timed-out compile is not kept: asking again compiles again (and is stopped again)
    with pytest.raises(GrammarError, match="stopped"):
        compiler.submit(regex("slow+")).result(timeout=60)
    assert compiler._processes["slow"].num_killed == 2


def test_one_client_cannot_take_every_compile_thread(compiler):
    held = compiler.submit(regex("slow*"), client="tenant-a")
    with pytest.raises(GrammarBusy, match="already has 1 grammar compiles in flight"):
        compiler.submit(regex("slow?"), client="tenant-a")
    assert compiler.submit(regex("b+"), client="tenant-b").result(timeout=60).compiled == "b+"
    assert compiler.submit(regex("slow*"), client="tenant-a") is held  # a cached spec is shared, not counted
    with pytest.raises(GrammarError):
        held.result(timeout=60)
    assert compiler.submit(regex("c+"), client="tenant-a").result(timeout=60).compiled == "c+"  # its turn again


def test_a_waiter_that_gives_up_drops_the_late_result(compiler):
    with pytest.raises(GrammarError, match="grammar compile timeout"):
        compiler.compile(regex("slow{2}"), timeout=0.2)
    assert not compiler._cache  # nothing kept for the failed request


def test_outlines_pathological_regex_is_stopped_and_a_trivial_one_still_compiles():
    """The reliability issue's case: a regex whose DFA explodes, on the outlines backend, with the real vocabulary."""
    pytest.importorskip("outlines_core")
    from deepserve.plugins.structured.plugin import make_outlines
    from test_structured import EOS, V4_VOCAB, real_tokenizer_json

    compiler = GrammarCompiler({"outlines": make_outlines}, TokenizerInfo(real_tokenizer_json(), V4_VOCAB, (EOS,)),
                               default_backend="outlines", timeout=3.0, max_workers=1)
    try:
        with pytest.raises(GrammarError, match="stopped"):
            compiler.submit(regex("([a-z]{1,30}[0-9]{1,30}){1500}")).result(timeout=120)
        trivial = compiler.submit(regex("[0-9]{5}"), client="another").result(timeout=120)
        assert trivial.new_matcher() is not None
    finally:
        compiler.shutdown()
