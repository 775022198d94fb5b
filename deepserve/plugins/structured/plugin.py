"""The built-in grammar backends, contributed through `deepserve_register_grammar_backends`.

`llguidance` (the default) handles JSON schema, JSON object, regex, Lark and GBNF/EBNF grammars, and choice.
`outlines` (outlines_core's index: regex, JSON schema, choice) and `xgrammar` (JSON schema, regex, GBNF, choice)
need their optional extras (`deepserve[outlines]`, `deepserve[xgrammar]`); they are registered either way, and a
request that picks one whose package is missing gets an error naming the package to install.
"""

from __future__ import annotations

from deepserve.core.hookspecs import Register, hookimpl
from deepserve.core.structured import GrammarBackend, TokenizerInfo


def make_llguidance(tokenizer: TokenizerInfo) -> GrammarBackend:
    from deepserve.plugins.structured.llguidance_backend import LLGuidanceBackend  # imports llguidance

    return LLGuidanceBackend(tokenizer)


def make_outlines(tokenizer: TokenizerInfo) -> GrammarBackend:
    from deepserve.plugins.structured.outlines_backend import OutlinesBackend  # imports outlines_core

    return OutlinesBackend(tokenizer)


def make_xgrammar(tokenizer: TokenizerInfo) -> GrammarBackend:
    from deepserve.plugins.structured.xgrammar_backend import XGrammarBackend  # imports xgrammar

    return XGrammarBackend(tokenizer)


@hookimpl
def deepserve_register_grammar_backends(register: Register) -> None:
    register("llguidance", make_llguidance)
    register("outlines", make_outlines)
    register("xgrammar", make_xgrammar)
