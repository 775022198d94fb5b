"""Meta-tests: every hook has a test that names it, and every hook is documented in docs/plugins.md."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from deepserve.core import hookspecs

TESTS = Path(__file__).resolve().parent
PLUGINS_DOC = TESTS.parent / "docs" / "plugins.md"


def hookspec_functions() -> dict[str, Callable]:
    marker = f"{hookspecs.PROJECT}_spec"  # what `HookspecMarker` sets on each spec
    return {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, marker)}


HOOKS = hookspec_functions()


def test_the_hooks_are_the_eight_of_the_design():
    assert sorted(HOOKS) == [
        "deepserve_register_cache_backends",
        "deepserve_register_dp_routers",
        "deepserve_register_expert_transports",
        "deepserve_register_grammar_backends",
        "deepserve_register_proposers",
        "deepserve_register_routes",
        "deepserve_request_finished",
        "deepserve_select_backend",
    ]


@pytest.mark.parametrize("hook_name", sorted(HOOKS))
def test_every_hook_has_a_test(hook_name: str):
    others = [path for path in TESTS.rglob("*.py") if path.resolve() != Path(__file__).resolve()]
    assert any(hook_name in path.read_text() for path in others), f"no test under tests/ names {hook_name}"


@pytest.mark.parametrize("hook_name", sorted(HOOKS))
def test_every_hook_is_documented_with_its_signature(hook_name: str):
    signature = f"{hook_name}({', '.join(inspect.signature(HOOKS[hook_name]).parameters)})"
    assert f"`{signature}`" in PLUGINS_DOC.read_text(), f"docs/plugins.md does not document `{signature}`"


@pytest.mark.parametrize("hook_name", sorted(HOOKS))
def test_every_hook_docstring_says_when_it_is_called_and_what_to_return(hook_name: str):
    doc = inspect.getdoc(HOOKS[hook_name]) or ""
    assert "Called" in doc and ":return:" in doc
    for parameter in inspect.signature(HOOKS[hook_name]).parameters:
        assert f":param {parameter}:" in doc
    if getattr(HOOKS[hook_name], f"{hookspecs.PROJECT}_spec")["firstresult"]:
        assert "first non-None wins" in doc
