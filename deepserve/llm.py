"""The offline API in vLLM's shape: `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

`LLM` assembles the engine: backend (chosen by the plugin hooks), model, paged KV cache sized from a memory
budget, KV manager with prefix caching, scheduler with cost-model chunked prefill, model runner, and the
`EngineCore` whose `step()` overlaps planning with the device. `generate` adds every prompt and steps until
all are done; requests run together (continuous batching).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

from tqdm import tqdm

from deepserve.core.config import EngineConfig
from deepserve.core.engine import EngineCore
from deepserve.core.env import default_model_dir
from deepserve.core.kv.manager import KVCacheManager, pages_for_budget
from deepserve.core.outputs import RequestOutput
from deepserve.core.plugins import collect_registrations, make_plugin_manager, select_backend
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.scheduler.cost_model import CostModelConfig, StepCostModel
from deepserve.core.scheduler.scheduler import Scheduler
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.structured import TokenizerInfo

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int], dict[str, Any]]
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


class LLM:
    """Load a DeepSeek-V4 checkpoint directory and generate from it.

    `model` is a local Hugging Face-style directory (`config.json`, safetensors, `tokenizer.json`); when omitted,
    `DEEPSERVE_MODEL` (or DeepInfer's `DEEPINFER_HF_MODEL_DIR`) names it, else the embedded default model. `accelerator` (`auto|cpu|nvidia|
    ascend`, or `DEEPSERVE_ACCELERATOR`) picks the backend through the plugin hooks. The KV cache gets
    `kv_cache_bytes`, or on a GPU `gpu_memory_utilization` of the device minus what the weights took.
    Structured output (`SamplingParams(structured_outputs=...)`) uses the grammar backend plugin named by
    `structured_outputs_backend` unless a request names another; grammars compile on
    `grammar_compile_workers` threads and a request whose grammar takes longer than `grammar_compile_timeout`
    seconds fails.

    `speculative_config` (vLLM's shape, `{"method": "mtp" | "dspark", "num_speculative_tokens": 5}`, a JSON
    string, or `DEEPSERVE_SPECULATIVE_CONFIG`) turns on speculative decoding with a proposer registered through
    `deepserve_register_proposers` (docs/speculative.md).

    On a backend that supports it (NVIDIA with its Triton kernels), decode steps replay CUDA graphs captured per
    batch-size bucket on first use (`deepserve.model.cuda_graphs`); `enforce_eager=True` launches every kernel
    instead. Speculative decoding runs eagerly.
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
        block_size: int = 256,
        enable_prefix_caching: bool = True,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        step_time_target: float = 0.5,
        async_scheduling: bool = True,
        load_plugins: bool = True,
        structured_outputs_backend: str = "llguidance",
        grammar_compile_timeout: float = 10.0,
        grammar_compile_workers: int = 2,
        speculative_config: Any = None,
        enforce_eager: bool = False,
    ) -> None:
        from deepserve.model.factory import load_model
        from deepserve.model.kv_cache import PagedKVCache, bytes_per_page
        from deepserve.model.cuda_graphs import DecodeGraphs
        from deepserve.model.runner import ModelRunner
        from deepserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
        from deepserve.core.env import env_value

        model = model if model is not None else default_model_dir()
        if model is None:
            raise ValueError("no model given: pass LLM(model=PATH) or set DEEPSERVE_MODEL (or DEEPINFER_HF_MODEL_DIR);"
                             " the embedded default model is not installed")
        if speculative_config is None:
            speculative_config = env_value("DEEPSERVE_SPECULATIVE_CONFIG")
        self.config = EngineConfig(model=str(model), dtype=dtype, accelerator=accelerator, device=device, seed=seed,
                                   max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   speculative_config=speculative_config)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.plugin_manager = make_plugin_manager(load_entrypoints=load_plugins)
        self.backend = select_backend(self.plugin_manager, self.config)
        self.model = load_model(model, self.backend, dtype)
        cfg = self.model.cfg
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.tokenizer = Tokenizer(model, cfg) if (Path(model) / "tokenizer.json").is_file() else None
        self.proposer = self._proposer(self.config.speculative_config, model)

        weight_dtype = self.model.lm_head.weight.dtype
        with_mtp = self.proposer is not None
        page_bytes = bytes_per_page(self.model, block_size, weight_dtype, with_mtp)
        budget = kv_cache_bytes if kv_cache_bytes is not None else self._default_budget(gpu_memory_utilization)
        needed = max_num_seqs * math.ceil(self.max_model_len / block_size)
        num_pages = min(pages_for_budget(budget, page_bytes), needed)
        self.kv_manager = KVCacheManager(num_pages, block_size, enable_prefix_caching)
        # the scratch region holds a step's new rows, so that prompt chunks take the batched path as well
        self.cache = PagedKVCache(self.model, num_pages, block_size, max_num_seqs, with_mtp=with_mtp,
                                  max_step_tokens=max(max_num_batched_tokens, 16 * max_num_seqs))
        logger.info("KV cache: %d pages of %d tokens (%d tokens)", num_pages, block_size, num_pages * block_size)
        self.cost_model = StepCostModel(CostModelConfig(step_time_target=step_time_target))
        scheduler = Scheduler(self.kv_manager, self.cost_model, max_num_seqs, max_num_batched_tokens,
                              self.max_model_len, cfg.eos_token_ids)
        spec = self.config.speculative_config
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else None
        detok = (lambda ids, skip: IncrementalDetokenizer(self.tokenizer, ids, skip)) if self.tokenizer else None
        self.graphs = None
        if self.backend.cuda_graphs and not enforce_eager and self.proposer is None:
            self.graphs = DecodeGraphs(self.model, self.cache, max_num_seqs, math.ceil(self.max_model_len / block_size))
        self.runner = ModelRunner(self.model, self.backend, self.cache, decode, proposer=self.proposer,
                                  graphs=self.graphs)
        grammars = self._grammar_compiler(structured_outputs_backend, grammar_compile_timeout,
                                          grammar_compile_workers)
        self.engine = EngineCore(scheduler, self.runner, page_size=block_size,
                                 enable_prefix_caching=enable_prefix_caching, make_detokenizer=detok,
                                 cost_model=self.cost_model, async_scheduling=async_scheduling, seed=seed,
                                 grammars=grammars,
                                 num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                 verify_planner=self.proposer.planner if self.proposer else None)
        self._ids = itertools.count()
        self.async_owner = None  # set by AsyncEngine.from_pretrained: the engine thread then owns the core
        logger.info("deepserve: %s on %s (%s), max_model_len %d", model, self.backend.device, self.backend.name,
                    self.max_model_len)

    def _proposer(self, spec, model_dir):
        """The speculative proposer that `spec.method` names among the `deepserve_register_proposers` plugins."""
        if spec is None:
            return None
        factories = collect_registrations(self.plugin_manager, "deepserve_register_proposers")
        if spec.method not in factories:
            raise ValueError(f"speculative_config.method {spec.method!r} is not a registered proposer; "
                             f"available: {sorted(factories)}")
        return factories[spec.method](model=self.model, config=spec, model_dir=str(model_dir))

    def _grammar_compiler(self, backend: str, timeout: float, workers: int) -> GrammarCompiler | None:
        """The structured-output compiler over the grammar backend plugins, or None without a tokenizer."""
        factories = collect_registrations(self.plugin_manager, "deepserve_register_grammar_backends")
        if self.tokenizer is None or not factories:
            return None
        cfg = self.model.cfg
        info = TokenizerInfo(self.tokenizer.to_str(), cfg.vocab_size,
                             tuple(cfg.eos_token_ids) or self.tokenizer.eos_token_ids)
        compiler = GrammarCompiler(factories, info, backend, timeout, max_workers=workers)
        compiler.warm_up()  # the backend's tokenizer tables build on a worker thread, not in anyone's request
        return compiler

    def _default_budget(self, utilization: float) -> int:
        import torch

        device = torch.device(self.backend.device)
        if device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(device)
        return max(int(free - (1 - utilization) * total), 0)

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
            sampling_params = SamplingParams()
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
