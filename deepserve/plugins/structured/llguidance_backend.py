"""The llguidance grammar backend: JSON schema, JSON object, regex, Lark, GBNF/EBNF and choice constraints.

One `LLGuidanceBackend` per tokenizer: building llguidance's token trie from `tokenizer.json` takes about 1.6 s for
DeepSeek-V4's 129,280 ids, so the compiler builds it once, on a worker thread. A compiled grammar is a prototype
`LLMatcher` whose lexer and parser tables are built; each request gets a deep copy (about a microsecond).
Bitmask rows are filled in parallel by llguidance's own thread pool, which runs without the GIL. (The module
`llguidance.torch` is not imported: it runs `torch.compile` at import, which takes seconds.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepserve.core.interfaces import BackendUnavailable
from deepserve.core.structured import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec, TokenizerInfo

try:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark
except ImportError as exc:  # raised when the backend is built, i.e. when a request first asks for it
    raise BackendUnavailable("the llguidance grammar backend needs the llguidance package: "
                             "pip install llguidance") from exc

#: the schema `json_object` compiles: any JSON object
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def escape_regex(text: str) -> str:
    """`text` as a regex that matches exactly it: every character but ASCII letters, digits and `_` as `\\x{..}`
    (safe inside llguidance's Lark `/.../` and Rust's regex syntax alike)."""
    return "".join(c if (c.isascii() and c.isalnum()) or c == "_" else f"\\x{{{ord(c):X}}}" for c in text)


def check_bitmask(bitmask: torch.Tensor) -> None:
    """Refuse what a grammar engine writing through a raw pointer would corrupt: anything but a contiguous int32
    CPU matrix."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
            or not bitmask.is_contiguous():
        raise ValueError(f"a grammar bitmask must be a contiguous int32 CPU matrix, got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("_matcher", "_stop_token_ids")

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int] = frozenset()) -> None:
        self._matcher, self._stop_token_ids = matcher, stop_token_ids

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self._stop_token_ids

    def consume(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask)
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def is_error(self) -> bool:
        return self._matcher.is_error()

    def error_message(self) -> str:
        return self._matcher.get_error()

    def rollback(self, num_tokens: int) -> None:
        if not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def forced_tokens(self) -> list[int]:
        return self._matcher.compute_ff_tokens()


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: TokenizerInfo, num_threads: int | None = None) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tokenizer_json, n_vocab=tokenizer.vocab_size,
                                                eos_token=list(tokenizer.eos_token_ids) or None)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._executor = llguidance.LLExecutor(num_threads)
        self._pin = torch.cuda.is_available()

    def grammar(self, spec: GrammarSpec) -> str:
        """llguidance's grammar definition for `spec` (not yet checked)."""
        json_options = {"whitespace_flexible": not spec.compact_json}
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=json_options)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, defaults=json_options)
        if spec.kind == "regex":
            pattern = llguidance.regex_to_lark(spec.spec, "dws" if spec.ascii_classes else "")
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{pattern}/")
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(escape_regex(c) for c in spec.choices))
        if spec.kind == "grammar":
            try:
                lark = any_to_lark(spec.spec)  # Lark as it is; GBNF (llama.cpp's EBNF) converted
            except Exception as exc:  # noqa: BLE001 - the converter's errors name the position
                raise GrammarError(f"invalid grammar (neither Lark nor GBNF): {exc}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
        raise GrammarError(f"the llguidance backend does not handle {spec.kind!r} constraints")

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            grammar = self.grammar(spec)
        except ValueError as exc:
            raise GrammarError(f"invalid {spec.description}: {exc}") from None
        prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if prototype.is_error():
            raise GrammarError(f"invalid {spec.description}: {prototype.get_error().strip()}")
        return prototype

    def new_matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self.stop_token_ids)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=self._pin)

    def fill_bitmasks(self, bitmask: torch.Tensor, rows: Sequence[tuple[GrammarMatcher, int]]) -> list[int]:
        check_bitmask(bitmask)
        num_rows, words = bitmask.shape
        self._executor.unsafe_compute_mask_ptr([(m._matcher, row) for m, row in rows], bitmask.data_ptr(),
                                               words * 4, num_rows)
        index = torch.tensor([row for _, row in rows], dtype=torch.long)
        empty = (bitmask.index_select(0, index) == 0).all(dim=1).tolist()
        return [row for (matcher, row), none in zip(rows, empty) if none or matcher.is_error()]
