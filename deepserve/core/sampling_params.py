"""`SamplingParams`: how one request picks its tokens and when it stops, in vLLM's shape.

Field names, defaults and the meaning of "off" values follow vLLM's `SamplingParams`, so user code written for
vLLM's offline API runs unchanged for the fields listed here. Validation happens once, at construction; every
error is a `ValueError` that names the field and the offending value. Plain Python: no torch here.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

from deepserve.core.kv.store import check_ttl_class
from deepserve.core.structured import GrammarSpec

#: temperatures below this are treated as 0 (greedy), as vLLM does; dividing logits by them would overflow
GREEDY_TEMPERATURE_EPS = 1e-5
_INT64_MIN, _UINT64_END = -(2**63), 2**64


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _int_field(name: str, value: Any, minimum: int | None = None) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _float_field(name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars and 0-d tensors convert; strings and None do not
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return value


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping options of one request (vLLM semantics).

    `temperature=0` is greedy (lowest token id on ties); `top_k` 0 or -1, `top_p=1` and `min_p=0` are off.
    `max_tokens=None` generates until the context is full; `max_tokens=0` computes the prompt only (for its
    `prompt_logprobs`) and finishes with reason "length" and no token. `logprobs=k` returns, for every generated token, the
    sampled token's logprob plus the k most likely tokens' (the same for `prompt_logprobs` over the prompt).
    `stop` strings end generation and are cut from the text unless `include_stop_str_in_output`;
    `stop_token_ids` end it like EOS does. `seed` makes a request's draws reproducible whatever else is batched.
    `structured_outputs` constrains the output: `{"json": schema}` (a dict or JSON text), `{"regex": str}`,
    `{"grammar": str}` (Lark, or GBNF/EBNF), `{"choice": [str, ...]}` or `{"json_object": True}`, optionally with
    `"backend"`, `"compact_json"` and `"ascii_classes"` (see `deepserve.core.structured.GrammarSpec`).
    After construction `stop` is always a list of strings, `stop_token_ids` a list of ints (maybe empty) and
    `structured_outputs` a `GrammarSpec` or None.

    Logits processing (vLLM's semantics, applied on the device before temperature and the filters; a request
    that sets none of these pays nothing): `presence_penalty` / `frequency_penalty` in [-2, 2] subtract from
    each token's logit once if it occurs in the output so far / once per occurrence; `repetition_penalty` > 0
    (1 = off) divides a positive logit (multiplies a negative one) of every token in the prompt or the output;
    `logit_bias` maps token ids to a number in [-100, 100] added to their logit; `bad_words` are strings the
    output must not contain as tokens: `update_from_tokenizer(encode)` turns them into `bad_words_token_ids`
    (each word with and without a leading space, as vLLM does), which the engine needs; a one-token word is
    never sampled, a longer one's last token is blocked where the output ends with the word's other tokens.

    `detokenize=False` (vLLM's): the engine leaves the output's `text` empty, for a caller that decodes the
    token ids itself (the server's chat routes: deepseek-recipe's stream processor does); stop strings need it.

    `cache_ttl` (deepserve's, the `cache_ttl` request field): the retention class of the KV blocks this request
    writes to a block store, `"agent"` (3 days) or `"chat"` (7 days); None: the engine's `kv_store_ttl_class`
    (docs/cache.md). No effect without a store.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: GrammarSpec | dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    detokenize: bool = True
    cache_ttl: str | None = None

    def __post_init__(self) -> None:
        self.n = _int_field("n", self.n, minimum=1)
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: deepserve returns one completion per request (use n=1)")
        self.temperature = _float_field("temperature", self.temperature)
        if self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        self.top_p = _float_field("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int_field("top_k", self.top_k, minimum=-1)
        if self.top_k == -1:  # vLLM's older spelling of "off"
            self.top_k = 0
        self.min_p = _float_field("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _int_field("seed", self.seed)
            if not _INT64_MIN <= self.seed < _UINT64_END:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        if self.max_tokens is not None:
            self.max_tokens = _int_field("max_tokens", self.max_tokens, minimum=0)
        self.min_tokens = _int_field("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            self.logprobs = _int_field("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int_field("prompt_logprobs", self.prompt_logprobs, minimum=0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            self.structured_outputs = GrammarSpec.parse(self.structured_outputs)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float_field(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _float_field("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.bad_words is not None:
            items = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(items, (list, tuple)) or not all(isinstance(w, str) and w for w in items):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(items) or None
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if not isinstance(words, (list, tuple)) or not all(
                    isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w) for w in words):
                raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token ids, got {words!r}")
            self.bad_words_token_ids = [[operator.index(t) for t in w] for w in words] or None
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: they are found in the output's text")
        if self.cache_ttl is not None:
            check_ttl_class(self.cache_ttl, "cache_ttl")

    @staticmethod
    def _normalize_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r:.60}")
        result = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
            if not _is_int(token) or operator.index(token) < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative ints), got {key!r}")
            value = _float_field(f"logit_bias[{key!r}]", value)
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {value}")
            result[operator.index(token)] = value
        return result or None

    def update_from_tokenizer(self, encode) -> None:
        """Tokenize `bad_words` into `bad_words_token_ids` with `encode` (text -> ids, no special tokens): each
        word alone and after a space, the two spellings a word has mid-text (vLLM's rule). Idempotent."""
        if not self.bad_words:
            return
        words: list[list[int]] = [list(w) for w in self.bad_words_token_ids or ()]
        for word in self.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = list(encode(text))
                if ids and ids not in words:
                    words.append(ids)
        self.bad_words_token_ids = words or None

    @property
    def uses_logits_processors(self) -> bool:
        """True when a penalty, a logit bias or bad words change this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.bad_words_token_ids or self.bad_words)

    @property
    def reads_output_history(self) -> bool:
        """True when the logits processing reads the tokens generated so far (penalties, multi-token bad
        words): the engine then hands the runner this request's output token ids every step."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or any(len(w) > 1 for w in self.bad_words_token_ids or ()))

    @staticmethod
    def _normalize_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"stop must contain only strings, got {item!r} in {stop!r}")
            if not item:
                raise ValueError(f"stop strings must be non-empty, got {stop!r}")
        return list(items)

    @staticmethod
    def _normalize_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of ints or None, got {ids!r}")
        ids = list(ids)
        for token_id in ids:
            if not _is_int(token_id) or operator.index(token_id) < 0:
                raise ValueError(f"stop_token_ids must contain only non-negative ints, got {token_id!r} in {ids!r}")
        return [operator.index(t) for t in ids]

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1
