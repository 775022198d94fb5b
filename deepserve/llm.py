"""The offline API in vLLM's shape: `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

Requests run together: every step batches the next prompt chunk or decode token of every unfinished request
(prompt chunks share a token budget, `max_num_batched_tokens`). The engine issue replaces this loop with the
scheduler, the paged KV cache and the asynchronous engine; the public surface stays.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from tqdm import tqdm

from deepserve.core.config import EngineConfig
from deepserve.core.env import env_value
from deepserve.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepserve.core.plugins import make_plugin_manager, select_backend
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.stop_checker import StopStringTracker, check_stop, min_tokens_blocked_ids

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int], dict[str, Any]]


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    state: Any
    detok: Any
    stops: StopStringTracker
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class LLM:
    """Load a DeepSeek-V4 checkpoint directory and generate from it.

    `model` is a local Hugging Face-style directory (`config.json`, safetensors, `tokenizer.json`); when omitted,
    `DEEPSERVE_MODEL` (or DeepInfer's `DEEPINFER_HF_MODEL_DIR`) names it. `accelerator` (`auto|cpu|nvidia|
    ascend`, or `DEEPSERVE_ACCELERATOR`) picks the backend through the plugin hooks.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "auto",
        device: str | None = None,
        accelerator: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        load_plugins: bool = True,
    ) -> None:
        from deepserve.model.factory import load_model
        from deepserve.model.runner import ModelRunner
        from deepserve.model.tokenizer import Tokenizer

        model = model if model is not None else env_value("DEEPSERVE_MODEL")
        if model is None:
            raise ValueError("no model given: pass LLM(model=PATH) or set DEEPSERVE_MODEL (or DEEPINFER_HF_MODEL_DIR)")
        self.config = EngineConfig(model=str(model), dtype=dtype, accelerator=accelerator, device=device, seed=seed,
                                   max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.plugin_manager = make_plugin_manager(load_entrypoints=load_plugins)
        self.backend = select_backend(self.plugin_manager, self.config)
        self.model = load_model(model, self.backend, dtype)
        cfg = self.model.cfg
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.tokenizer = Tokenizer(model, cfg) if (Path(model) / "tokenizer.json").is_file() else None
        self.eos_token_ids = list(cfg.eos_token_ids)
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else None
        self.runner = ModelRunner(self.model, self.backend, decode)
        self._ids = itertools.count()
        logger.info("deepserve: %s on %s (%s), max_model_len %d", model, self.backend.device, self.backend.name,
                    self.max_model_len)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        waiting, running = list(requests), []
        with tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while waiting or running:
                while waiting and len(running) < self.config.max_num_seqs:
                    running.append(waiting.pop(0))
                self._step(running)
                done = [r for r in running if r.finish_reason is not None]
                running = [r for r in running if r.finish_reason is None]
                bar.update(len(done))
        return [self._output(r) for r in requests]

    # -- one step for every running request --------------------------------------------------------------
    def _step(self, running: list[_Request]) -> None:
        from deepserve.model.runner import SeqWork

        budget, work, owners = self.max_num_batched_tokens, [], []
        for r in running:
            pending = len(r.all_ids) - r.num_computed
            n = min(pending, budget) if pending > 1 else 1
            if n <= 0:
                continue
            budget -= n
            start = r.num_computed
            ids = r.all_ids[start : start + n]
            in_prompt = start < len(r.prompt_ids)
            targets = None
            if in_prompt and r.params.prompt_logprobs is not None:
                targets = [r.prompt_ids[p + 1] if p + 1 < len(r.prompt_ids) else None for p in range(start, start + n)]
            work.append(SeqWork(
                state=r.state, token_ids=ids, start=start, params=r.params, seed=r.seed,
                sample=start + n == len(r.all_ids),
                blocked_ids=min_tokens_blocked_ids(r.params, self.eos_token_ids, len(r.output_ids)),
                prompt_targets=targets,
            ))
            owners.append(r)
        for r, w, res in zip(owners, work, self.runner.step(work)):
            r.num_computed += len(w.token_ids)
            if r.prompt_logprobs is not None:
                r.prompt_logprobs.extend(res.prompt_logprobs)
            if res.token_id is not None:
                self._append(r, res)

    def _append(self, r: _Request, res) -> None:
        r.output_ids.append(res.token_id)
        if r.logprobs is not None:
            r.logprobs.append(res.logprobs)
            r.cumulative_logprob += res.logprob
        reason, stop_reason = check_stop(res.token_id, len(r.output_ids), len(r.all_ids), r.params,
                                         self.eos_token_ids, self.max_model_len)
        token_stop = reason == "stop" and not r.params.include_stop_str_in_output
        if r.detok is not None and not token_stop:  # as in vLLM, an EOS / stop-id token adds no text
            match = r.stops.append(r.detok.add(res.token_id), check=len(r.output_ids) > r.params.min_tokens)
            if match is not None:
                reason, stop_reason = "stop", match.stop
        if reason is not None:
            r.finish_reason, r.stop_reason = reason, stop_reason

    # -- requests in, outputs out ------------------------------------------------------------------------
    def _as_list(self, prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _make_request(self, prompt: PromptType, params: SamplingParams) -> _Request:
        from deepserve.model.tokenizer import IncrementalDetokenizer

        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer.json: pass prompts as token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        else:
            ids = list(prompt)
        vocab = self.model.cfg.vocab_size
        if not ids:
            raise ValueError("prompt is empty: it needs at least one token")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             "no room to generate")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has no tokenizer.json")
        rid = next(self._ids)
        seed = params.seed if params.seed is not None else hash((self.config.seed, rid)) & (2**63 - 1)
        detok = (IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        return _Request(
            request_id=str(rid), prompt=text, prompt_ids=ids, params=params, seed=seed,
            state=self.runner.new_state(), detok=detok,
            stops=StopStringTracker(params.stop, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def _output(self, r: _Request) -> RequestOutput:
        if r.detok is not None and r.stops.match is None and r.finish_reason != "stop":
            r.stops.append(r.detok.flush(), check=False)
        completion = CompletionOutput(
            index=0, text=r.stops.text, token_ids=list(r.output_ids),
            cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
            logprobs=r.logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
        )
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_ids,
                             prompt_logprobs=r.prompt_logprobs, outputs=[completion], finished=True)
