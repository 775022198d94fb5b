"""Text <-> token ids: a thin wrapper over Hugging Face `tokenizers`, an incremental detokenizer for streaming,
and `make_byte_tokenizer`, which writes a tiny byte-level `tokenizer.json` for tests and demo checkpoints.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from deepserve.core.config import ModelConfig

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
#: tokens before the first new one that are decoded again for context (word-boundary spaces, e.g. SentencePiece)
_CONTEXT_TOKENS = 5


def _special_content(value: Any) -> str | None:
    """`tokenizer_config.json` spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """The tokenizer of a checkpoint directory (or a `tokenizer.json` path).

    BOS/EOS ids come from `config` (the model's `config.json`) when given, else from `tokenizer_config.json`,
    else from DeepSeek's special-token names. `encode` adds what the tokenizer's post-processor adds, plus a BOS
    when `tokenizer_config.json` says `add_bos_token` (as Hugging Face's tokenizer would).
    """

    def __init__(self, path: str | os.PathLike, config: ModelConfig | None = None) -> None:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception subclasses for bad JSON
            raise ValueError(f"cannot load tokenizer {file}: {exc}") from exc
        extra = self._read_tokenizer_config(file.parent / "tokenizer_config.json")
        self.add_bos_by_default = bool(extra.get("add_bos_token", False))
        self.special_token_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

        bos = config.bos_token_id if config is not None else None
        if bos is None:
            bos = self._id_of(_special_content(extra.get("bos_token")) or BOS_TOKEN)
        self.bos_token_id: int | None = bos
        eos_ids = list(config.eos_token_ids) if config is not None else []
        if not eos_ids:
            eos = self._id_of(_special_content(extra.get("eos_token")) or EOS_TOKEN)
            eos_ids = [] if eos is None else [eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)

    @staticmethod
    def _read_tokenizer_config(file: Path) -> dict[str, Any]:
        if not file.is_file():
            return {}
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {file}: {exc}") from exc
        return data if isinstance(data, dict) else {}

    def _id_of(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (a model may declare several; `eos_token_ids` has them all)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (may be less than the model's padded vocab)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. `add_bos=None` follows the tokenizer's own configuration, True makes sure the
        ids start with BOS (never doubled), False adds no special tokens at all."""
        ids = self._tok.encode(text, add_special_tokens=add_bos is not False).ids
        wants_bos = add_bos if add_bos is not None else self.add_bos_by_default
        if wants_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_str(self) -> str:
        """The tokenizer as `tokenizer.json` text (what grammar engines such as llguidance are built from)."""
        return self._tok.to_str()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (prefix/read offsets).

    Each step decodes the new tokens together with a few earlier ones (`prefix_offset..`) and returns what
    extends the earlier ones' text. Text ending in U+FFFD is held back: with byte-level BPE a multi-byte UTF-8
    character split across tokens decodes as U+FFFD until its last byte arrives. `flush()` returns whatever is
    still held when the request ends. Joined, the deltas and the flush equal `decode(output ids)`.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "num_prompt_tokens", "prefix_offset",
                 "read_offset", "text")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.prefix_offset = max(len(self.token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""  # the output text returned so far

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append one or more new token ids; return the text they complete (maybe "")."""
        ids = self.token_ids
        if type(token_ids) is int:  # one token, as the engine adds them: no ABC check (~1 us a token)
            ids.append(token_ids)
        elif isinstance(token_ids, Iterable):
            ids.extend(operator.index(t) for t in token_ids)
        else:
            ids.append(operator.index(token_ids))
        decode, start, skip = self.tokenizer.decode, self.prefix_offset, self.skip_special_tokens
        prefix_text = decode(ids[start : self.read_offset], skip)
        new_text = decode(ids[start:], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The held-back tail (it may contain U+FFFD if the bytes never formed a character)."""
        delta = self._decode(self.prefix_offset)[len(self._decode(self.prefix_offset, self.read_offset)) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def _byte_chars() -> list[str]:
    """The printable stand-in of every byte used by byte-level BPE (GPT-2's byte-to-unicode table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def _learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges, initial_alphabet=_byte_chars(), show_progress=False, min_frequency=2
    )
    tok.train_from_iterator([text], trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]


def make_byte_tokenizer(
    path: str | os.PathLike,
    special_tokens: Sequence[str] = (),
    train_text: str | None = None,
    num_merges: int = 0,
) -> Path:
    """Write a byte-level BPE `tokenizer.json` and return its path (`path/tokenizer.json` if `path` is a
    directory). Ids: DeepSeek's BOS (0) and EOS (1), then `special_tokens`, then the 256 bytes in byte order,
    then up to `num_merges` merges learned from `train_text`. No post-processor: `encode` adds no BOS."""
    specials = [BOS_TOKEN, EOS_TOKEN] + [s for s in special_tokens if s not in (BOS_TOKEN, EOS_TOKEN)]
    if len(set(specials)) != len(specials):
        raise ValueError(f"special_tokens has duplicates: {list(special_tokens)}")
    if num_merges < 0:
        raise ValueError(f"num_merges must be >= 0, got {num_merges}")
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({c: len(specials) + b for b, c in enumerate(_byte_chars())})
    merges = _learn_merges(train_text, num_merges) if train_text and num_merges else []
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))

    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    file.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(file))
    return file
