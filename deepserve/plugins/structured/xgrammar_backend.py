"""The xgrammar grammar backend (the optional extra `deepserve[xgrammar]`): JSON schema, JSON object, regex,
GBNF/EBNF grammars and choice, through xgrammar's compiler and matchers. Lark grammars are llguidance's.

One `XGrammarBackend` per tokenizer holds xgrammar's `TokenizerInfo` (each token's bytes; special tokens given
no bytes, which xgrammar treats as special and never allows as text) and a `GrammarCompiler` without its own
cache (deepserve's compiler caches). Bitmask rows are filled in parallel by xgrammar's batch matcher.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import torch

from deepserve.core.interfaces import BackendUnavailable
from deepserve.core.structured import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec, TokenizerInfo
from deepserve.plugins.structured.llguidance_backend import JSON_OBJECT_SCHEMA
from deepserve.plugins.structured.vocabulary import token_bytes

try:
    import xgrammar
except ImportError as exc:  # raised when the backend is built, i.e. when a request first asks for it
    raise BackendUnavailable("the xgrammar grammar backend needs the xgrammar package: "
                             "pip install 'deepserve[xgrammar]'") from exc

#: how many tokens a matcher can roll back (speculative decoding's drafts)
MAX_ROLLBACK = 64
_SOURCE_PREFIX = re.compile(r"\[[0-9:]+\] \S+:[0-9]+: ")
_CLASS_ESCAPE = re.compile(r"\\[dwsDWS]")


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("matcher", "backend", "_error")

    def __init__(self, matcher: xgrammar.GrammarMatcher, backend: XGrammarBackend) -> None:
        self.matcher, self.backend = matcher, backend
        self._error = ""

    def consume(self, token_id: int) -> bool:
        if self._error:
            return False
        if not self.matcher.accept_token(token_id):
            self._error = f"token {token_id} is not allowed here"
            return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._error:
            bitmask[row] = 0
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """Complete and nothing but EOS may follow (xgrammar's own `is_terminated` means "EOS was accepted")."""
        if self._error:
            return False
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        scratch = self.backend.scratch
        self.matcher.fill_next_token_bitmask(scratch, 0)
        scratch[0, self.backend.eos_words] &= ~self.backend.eos_bits
        return not bool(scratch.any())

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self.backend.stop_token_ids

    def is_error(self) -> bool:
        return bool(self._error)

    def error_message(self) -> str:
        return self._error

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        return [] if self._error else list(self.matcher.find_jump_forward_tokens())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: TokenizerInfo, num_threads: int | None = None) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids)
        vocab = [data or b"" for data in token_bytes(tokenizer)]
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=tokenizer.vocab_size,
                                           stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=False)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(num_threads or min(8, os.cpu_count() or 1))
        self.scratch = self.allocate_bitmask(1)  # engine thread only
        eos = list(tokenizer.eos_token_ids)
        self.eos_words = torch.tensor([t >> 5 for t in eos], dtype=torch.long)
        self.eos_bits = torch.tensor([1 << (t & 31) for t in eos], dtype=torch.int64).to(torch.int32)

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        compact = {"any_whitespace": False, "separators": (",", ":")} if spec.compact_json else {}
        if spec.kind == "json":
            return self.compiler.compile_json_schema(spec.spec, strict_mode=True, **compact)
        if spec.kind == "json_object":
            return self.compiler.compile_json_schema(JSON_OBJECT_SCHEMA, strict_mode=True, **compact)
        if spec.kind == "regex":
            if not spec.ascii_classes and _CLASS_ESCAPE.search(spec.spec):
                raise GrammarError("the xgrammar backend matches \\d, \\w and \\s as ASCII only; "
                                   "ascii_classes=False needs the llguidance backend")
            return self.compiler.compile_regex(spec.spec)  # xgrammar's classes are ASCII already
        if spec.kind == "choice":  # a GBNF alternation of string literals (JSON escapes are GBNF's too)
            literals = " | ".join(json.dumps(c) for c in spec.choices)
            return self.compiler.compile_grammar(f"root ::= {literals}")
        if "::=" not in spec.spec:
            raise GrammarError("the xgrammar backend reads GBNF/EBNF grammars (`root ::= ...`), not Lark: use the "
                               "llguidance backend for a Lark grammar")
        return self.compiler.compile_grammar(spec.spec)

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        try:
            return self._compile(spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors are RuntimeErrors
            message = _SOURCE_PREFIX.sub("", str(exc)).strip()  # "[12:00:00] /project/cpp/x.cc:94: " goes
            raise GrammarError(f"invalid {spec.description}: {message}") from None

    def new_matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK), self)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32,
                          pin_memory=torch.cuda.is_available())

    def fill_bitmasks(self, bitmask: torch.Tensor, rows: Sequence[tuple[GrammarMatcher, int]]) -> list[int]:
        live = [(m, row) for m, row in rows if not m.is_error()]
        for matcher, row in rows:
            if matcher.is_error():
                matcher.fill_bitmask(bitmask, row)
        if live:
            self.batch.batch_fill_next_token_bitmask([m.matcher for m, _ in live], bitmask, [row for _, row in live])
        index = torch.tensor([row for _, row in rows], dtype=torch.long)
        empty = (bitmask.index_select(0, index) == 0).all(dim=1).tolist()
        return [row for (matcher, row), none in zip(rows, empty) if none or matcher.is_error()]
