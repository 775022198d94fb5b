"""The offline API in vLLM's shape: `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

`LLM` builds its engine with `deepserve.build.build_engine` (the one composition root) and drives it on the
caller's thread: `generate` adds every prompt and steps until all are done; requests run together (continuous
batching).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any, Union

from tqdm import tqdm

from deepserve.build import build_engine, resolve_config
from deepserve.core.generation_config import engine_defaults, sampling_defaults
from deepserve.core.outputs import RequestOutput
from deepserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int], dict[str, Any]]


class LLM:
    """Load a DeepSeek-V4 checkpoint directory and generate from it.

    `model` is a local Hugging Face-style directory (`config.json`, safetensors, `tokenizer.json`); when omitted,
    `DEEPSERVE_MODEL` (or DeepInfer's `DEEPINFER_HF_MODEL_DIR`) names it, else the embedded default model.
    `options` are `deepserve.core.config.EngineConfig`'s fields (vLLM's names: `dtype`, `accelerator`,
    `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`, `block_size`, `enable_prefix_caching`,
    `kv_cache_bytes`, `gpu_memory_utilization`, `async_scheduling`, `structured_outputs_backend`,
    `grammar_compile_timeout`, `speculative_config`, `enforce_eager`, ...); an unknown one is a TypeError.
    `deepserve.build.build_engine` assembles the engine.

    `speculative_config` (`{"method": "mtp" | "dspark", "num_speculative_tokens": 5}`, a JSON string, or
    `DEEPSERVE_SPECULATIVE_CONFIG`) turns on speculative decoding with a proposer registered through
    `deepserve_register_proposers` (docs/speculative.md). On a backend that supports it (NVIDIA with its Triton
    kernels), decode steps replay CUDA graphs captured per batch-size bucket on first use
    (`deepserve.model.cuda_graphs`); `enforce_eager=True` launches every kernel instead. With speculative
    decoding the MTP drafter's chain replays its own graphs (`deepserve.model.draft_graphs`); the verify steps
    run eagerly.
    """

    def __init__(self, model: str | os.PathLike | None = None, **options: Any) -> None:
        config = resolve_config(model, **options)
        #: the model's sampling defaults (`generation_config`): `SamplingParams` keyword arguments; read before
        #: the engine is built, so a malformed file fails fast
        self.sampling_defaults = engine_defaults(sampling_defaults(config.generation_config, config.model),
                                                 speculative=config.speculative_config is not None)
        self.parts = build_engine(config)
        parts = self.parts
        self.config, self.plugin_manager, self.backend = parts.config, parts.plugin_manager, parts.backend
        self.model, self.tokenizer, self.max_model_len = parts.model, parts.tokenizer, parts.max_model_len
        self.proposer, self.kv_manager, self.cache = parts.proposer, parts.kv_manager, parts.cache
        self.cost_model, self.graphs, self.runner, self.engine = (parts.cost_model, parts.graphs, parts.runner,
                                                                  parts.engine)
        self._ids = itertools.count()
        self.async_owner = None  # set when an AsyncEngine drives this engine: its thread then owns the core

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        if self.async_owner is not None:
            raise RuntimeError("this LLM's engine is driven by an AsyncEngine; use AsyncEngine.generate")
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        parsed = [self._parse_prompt(p, sp) for p, sp in zip(prompts, params)]  # validate all before adding any
        self._compile_grammars(params)
        order = []
        for (text, ids), sp in zip(parsed, params):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, ids, sp, prompt=text, final_only=True)  # only the ends are read
            order.append(request_id)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id not in results:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[r] for r in order]

    # -- requests in ---------------------------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the parameters `generate` uses when given none, the model's `generation_config.json` sampling
        fields over the library's defaults (`generation_config="vllm"`: the library's alone)."""
        return SamplingParams(**self.sampling_defaults)

    def _compile_grammars(self, params: list[SamplingParams]) -> None:
        """Compile every structured-output spec now (in parallel, cached for the engine), so an invalid schema,
        regex or grammar, or a compile timeout, raises ValueError before any request runs."""
        specs = list(dict.fromkeys(sp.structured_outputs for sp in params if sp.structured_outputs is not None))
        if not specs:
            return
        grammars = self.engine.grammars
        if grammars is None:
            raise ValueError("structured outputs need a grammar backend: this model has no tokenizer.json "
                             "(or no grammar backend plugin is installed)")
        for spec in specs:
            grammars.submit(spec)
        for spec in specs:
            grammars.compile(spec)

    def _as_list(self, prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _parse_prompt(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
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
        return text, ids
