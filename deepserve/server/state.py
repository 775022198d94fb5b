"""What the app keeps between requests, under typed `web.AppKey`s (the admission gate: `admission.py`).

Plugin routes read the same keys: `request.app[ENGINE]` is the running `AsyncEngine`, `request.app[MODEL]` what
the server knows about the model it serves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from deepserve.core.async_engine import AsyncEngine
from deepserve.core.sampling_params import SamplingParams
from deepserve.server.admission import Admission
from deepserve.server.config import ServerConfig
from deepserve.server.errors import ApiError
from deepserve.server.metrics import ServerMetrics
from deepserve.server.recipe import RecipeCodec
from deepserve.server.tokenization import PromptBound, TextEncoder

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from deepserve.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model as the HTTP layer sees it. `encoder` tokenizes as `tokenizer` does, releasing the GIL;
    `prompt_bound` (None where the tokenizer allows no proof) refuses texts too long for the context unread."""

    name: str
    path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer | None
    encoder: TextEncoder | None = None
    prompt_bound: PromptBound | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    #: the model's sampling defaults (`LLM.sampling_defaults`, its generation_config.json's) for the fields a request
    #: leaves out, split once: `SamplingParams` keyword arguments but `max_tokens`, and the default `max_tokens`
    default_fields: dict = field(default_factory=dict)
    default_max_tokens: int | None = None

    @classmethod
    def from_engine(cls, engine: AsyncEngine, config: ServerConfig) -> ModelInfo:
        """Reads the tokenizer's whole vocabulary: call it off the event loop."""
        llm = engine.llm
        cfg, tokenizer = llm.model.cfg, llm.tokenizer
        encoder = TextEncoder(tokenizer) if tokenizer is not None else None
        bound = PromptBound.from_tokenizer_json(tokenizer.to_str()) if tokenizer is not None else None
        defaults = dict(getattr(llm, "sampling_defaults", {}))
        max_tokens = defaults.pop("max_tokens", None)
        return cls(config.model_name, str(config.model), llm.max_model_len, cfg.vocab_size,
                   tuple(cfg.eos_token_ids), tokenizer, encoder, bound, default_fields=defaults,
                   default_max_tokens=max_tokens)

    def check_prompt_text(self, text: str, param: str | None = None) -> None:
        """400 `context_length_exceeded` for a text that cannot fit the context whatever its tokens, found from
        its length alone (call it before tokenizing)."""
        if self.prompt_bound is not None:
            self.prompt_bound.check(text, self.max_model_len, param)

    def check_prompt(self, ids: list[int], param: str | None = None) -> None:
        """400 for a prompt that is empty, holds an id outside the vocabulary, or leaves no room for output."""
        if not ids:
            raise ApiError(400, "the prompt is empty: it needs at least one token", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param=param)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"the prompt is {len(ids)} tokens long but the model's context is "
                           f"{self.max_model_len} tokens, and at least one is needed for the output", param=param,
                           code="context_length_exceeded")

    def fit_params(self, params: SamplingParams) -> SamplingParams:
        """Keep valid sampling parameters inside what the engine's tensors hold (int64): a `top_k` past the
        vocabulary means "all tokens" (0), a seed of 2**63 or more is the same 64 bits as a signed int64; a
        stop token id outside the vocabulary can never be sampled (400). The engine thread dies on these today.
        A `logit_bias` token outside the vocabulary is a 400 too; `bad_words` are tokenized here."""
        if params.top_k > self.vocab_size:
            params.top_k = 0
        if params.seed is not None and params.seed >= 2**63:
            params.seed -= 2**64
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param="logit_bias")
        if params.bad_words:
            if self.encoder is None:
                raise ApiError(400, "'bad_words' needs a tokenizer and this model has none", param="bad_words")
            params.update_from_tokenizer(self.encoder.encode)
        return params


CONFIG = web.AppKey("deepserve_config", ServerConfig)
ENGINE = web.AppKey("deepserve_engine", AsyncEngine)
MODEL = web.AppKey("deepserve_model", ModelInfo)
ADMISSION = web.AppKey("deepserve_admission", Admission)
METRICS = web.AppKey("deepserve_metrics", ServerMetrics)
RECIPE = web.AppKey("deepserve_recipe", RecipeCodec)
#: (plugin registration name, method, path) of every route a `deepserve_register_routes` plugin added
PLUGIN_ROUTES = web.AppKey("deepserve_plugin_routes", list)
