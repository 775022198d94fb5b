"""Text -> token ids for the server, bounded first: `PromptBound` refuses a text too long for the context
from its byte count alone, before a tokenizer spends seconds on it; `TextEncoder` is the model tokenizer's
`encode` in a form that releases the GIL, so the pool thread running it does not stall the event loop.

The bound is a proof, not a guess. A byte-level BPE tokenizer without a normalizer splits a text into pieces
and each piece into vocabulary tokens, and every token stands for at most `max_token_bytes` bytes of the
text (the longest vocabulary entry, or the longest added-token spelling). So a text of B UTF-8 bytes has at
least ceil(B / max_token_bytes) tokens, whatever is in it; special tokens a template adds only add to that.
For other tokenizers (a normalizer that may shrink text, an unknown-token fallback that may cover any number
of bytes) nothing is provable, and `PromptBound.from_tokenizer_json` gives None: the full tokenization decides.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import tokenizers

from deepserve.server.errors import ApiError

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from deepserve.model.tokenizer import Tokenizer


def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE spells bytes with (GPT-2's table): each stands for one byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return frozenset(map(chr, kept + [256 + i for i in range(256 - len(kept))]))


def _is_byte_level(spec: dict | None) -> bool:
    if not isinstance(spec, dict):
        return False
    return spec.get("type") == "ByteLevel" or any(_is_byte_level(part) for part in spec.get("pretokenizers", ()))


class PromptBound:
    """At least ceil(bytes / `max_token_bytes`) tokens a text: `check` refuses one that cannot fit the context."""

    def __init__(self, max_token_bytes: int) -> None:
        if max_token_bytes < 1:
            raise ValueError(f"max_token_bytes must be >= 1, got {max_token_bytes}")
        self.max_token_bytes = max_token_bytes

    @classmethod
    def from_tokenizer_json(cls, text: str) -> PromptBound | None:
        """The bound of a `tokenizer.json`, or None where the tokenizer is not byte-level BPE without a
        normalizer (see the module docstring)."""
        spec = json.loads(text)
        model, normalizer = spec.get("model") or {}, spec.get("normalizer")
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            return None
        if normalizer is not None and normalizer != {"type": "Sequence", "normalizers": []}:
            return None
        if not _is_byte_level(spec.get("pre_tokenizer")):
            return None
        alphabet = _byte_level_alphabet()
        # a vocabulary entry spelled in the alphabet stands for one byte a character; any other is literal text
        longest = max((sum(1 if c in alphabet else len(c.encode("utf-8")) for c in token)
                       for token in model["vocab"]), default=1)
        added = max((len(t.get("content", "").encode("utf-8")) for t in spec.get("added_tokens") or ()), default=1)
        return cls(max(longest, added, 1))

    def check(self, text: str, max_model_len: int, param: str | None = None) -> None:
        """400 `context_length_exceeded` when `text` cannot fit the context (as `ModelInfo.check_prompt` says
        for counted tokens: at least one position is left for the output)."""
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        num_tokens = -(-num_bytes // self.max_token_bytes)
        if num_tokens >= max_model_len:
            raise ApiError(400, f"the prompt is at least {num_tokens} tokens long ({num_bytes} bytes, at most "
                           f"{self.max_token_bytes} bytes a token) but the model's context is {max_model_len} "
                           "tokens, and at least one is needed for the output", param=param,
                           code="context_length_exceeded")


class TextEncoder:
    """`encode(text)` gives the ids `Tokenizer.encode(text)` gives (the post-processor's tokens, then a BOS where
    `tokenizer_config.json` asks for one), through the batch call of Hugging Face `tokenizers`, which releases
    the GIL (`Tokenizer.encode` holds it: a 4 MB prompt stopped every other thread for seconds)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: faster
        self.bos_token_id = tokenizer.bos_token_id
        self.add_bos = tokenizer.add_bos_by_default

    def encode(self, text: str) -> list[int]:
        ids = self._encode_batch([text], add_special_tokens=True)[0].ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids
