"""The built-in grammar backends, contributed through `deepserve_register_grammar_backends`.

`llguidance` (the default) handles JSON schema, JSON object, regex, Lark and GBNF/EBNF grammars, and choice.
outlines and xgrammar are not built yet (see docs/structured.md).
"""

from __future__ import annotations

from deepserve.core.hookspecs import Register, hookimpl
from deepserve.core.structured import GrammarBackend, TokenizerInfo


def make_llguidance(tokenizer: TokenizerInfo) -> GrammarBackend:
    from deepserve.plugins.structured.llguidance_backend import LLGuidanceBackend  # imports llguidance

    return LLGuidanceBackend(tokenizer)


@hookimpl
def deepserve_register_grammar_backends(register: Register) -> None:
    register("llguidance", make_llguidance)
