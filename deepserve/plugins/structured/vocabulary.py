"""Each token's bytes, which the outlines and xgrammar backends need to build their token indexes.

llguidance (a core dependency) reads a Hugging Face `tokenizer.json` of any kind (byte-level BPE, SentencePiece
with byte fallback, WordPiece) and decodes each id alone to its bytes; special tokens (BOS, EOS, `<think>`, chat
markers) are reported as such, and the backends never allow them as text."""

from __future__ import annotations

import llguidance

from deepserve.core.structured import TokenizerInfo


def token_bytes(tokenizer: TokenizerInfo) -> list[bytes | None]:
    """`tokenizer.vocab_size` entries: the bytes of each id, None for special tokens and padding ids (no bytes)."""
    lltok = llguidance.LLTokenizer(tokenizer.tokenizer_json, n_vocab=tokenizer.vocab_size,
                                   eos_token=list(tokenizer.eos_token_ids) or None)
    out: list[bytes | None] = []
    for token in range(tokenizer.vocab_size):
        data = None if lltok.is_special_token(token) else lltok.decode_bytes([token])
        out.append(data or None)
    return out
