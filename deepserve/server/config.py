"""`ServerConfig`: everything `deepserve serve` decides before the app is built, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: server options that are engine (`LLM`) options of the same name
_ENGINE_OPTIONS = ("structured_outputs_backend", "grammar_compile_timeout")
#: the output limit of a chat, Responses request that sets none (lowered to the context the prompt leaves)
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Options of one server.

    `model` is the checkpoint directory; `engine_kwargs` go to `AsyncEngine.from_pretrained` unchanged (dtype,
    accelerator, max_model_len, max_num_seqs, ...). At most `max_num_seqs + max_waiting_requests` generation
    requests are open at once; one more gets 429 with `Retry-After`. `api_key` (when set) guards every `/v1/`
    route. A body over `max_body_bytes` gets 413. On shutdown, in-flight requests get `drain_timeout` seconds to
    finish before they are aborted. `/health` answers 503 while the engine has work and no step has completed
    for `engine_step_timeout` seconds. `default_thinking_mode` is the thinking mode of chat and Responses requests
    that do not choose (off: a plain OpenAI client gets its answer in `content`, as vLLM serves DeepSeek's hybrid
    models; Messages requests think only when they ask, as Anthropic's API does). `structured_outputs_backend` (the grammar backend plugin for requests
    that name none) and `grammar_compile_timeout` (seconds a constraint may take to compile; past it the request
    gets 400) go to the engine when set; None keeps the engine's defaults (`llguidance`, 10 s). A chat or Responses
    request that sets no output limit gets `default_max_tokens`, lowered to the context its prompt leaves.
    `stream_interval` (SGLang's `--stream-interval`): a request's handler reads its first output, then one each
    time that many tokens have come, and its final output, so a stream sends one chunk per N tokens.
    """

    model: str
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting_requests: int = 128
    max_body_bytes: int = 16 * 2**20
    drain_timeout: float = 30.0
    engine_step_timeout: float = 60.0
    retry_after_seconds: int = 1
    default_thinking_mode: bool = False
    structured_outputs_backend: str | None = None
    grammar_compile_timeout: float | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    stream_interval: int = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not self.engine_step_timeout > 0:
            raise ValueError(f"engine_step_timeout must be > 0, got {self.engine_step_timeout}")
        if self.retry_after_seconds < 1:
            raise ValueError(f"retry_after_seconds must be >= 1, got {self.retry_after_seconds}")
        if self.structured_outputs_backend is not None and (not isinstance(self.structured_outputs_backend, str)
                                                            or not self.structured_outputs_backend.strip()):
            raise ValueError(f"structured_outputs_backend must be a backend's name, got "
                             f"{self.structured_outputs_backend!r}")
        timeout = self.grammar_compile_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0 or timeout == float("inf")):
            raise ValueError(f"grammar_compile_timeout must be a positive number of seconds, got {timeout!r}")
        if type(self.default_max_tokens) is not int or self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        if type(self.stream_interval) is not int or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        for name in _ENGINE_OPTIONS:
            if getattr(self, name) is not None and name in self.engine_kwargs:
                raise ValueError(f"{name} is given twice: as a server option and in engine_kwargs")

    @property
    def engine_options(self) -> dict[str, Any]:
        """What the engine is built with: `engine_kwargs` plus the structured-output options that are set."""
        return {**self.engine_kwargs, **{name: getattr(self, name) for name in _ENGINE_OPTIONS
                                        if getattr(self, name) is not None}}

    @property
    def model_name(self) -> str:
        """The name clients send as `model`: `served_model_name`, else the directory's name."""
        return self.served_model_name or Path(self.model).resolve().name
