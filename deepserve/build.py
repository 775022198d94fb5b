"""The composition root: `build_engine(config)` assembles one engine from an `EngineConfig` and the plugin manager.

`LLM`, `AsyncEngine.from_pretrained`, the server and (next) each rank process all build through here, so an
engine is put together in one way: backend (chosen by the plugin hooks), model (by the registry's
`model_type`), tokenizer, speculative proposer, paged KV cache sized from a memory budget, KV manager with
prefix caching, scheduler with cost-model chunked prefill, CUDA graphs where the backend has them, model
runner, grammar compiler, the block stores the plugins offer, and the `EngineCore` that steps them. It lives outside `deepserve.core`, which it
imports, so that `core` stays importable without torch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepserve.core.config import EngineConfig
from deepserve.core.engine import EngineCore
from deepserve.core.env import default_model_dir, env_value
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.interfaces import Backend
from deepserve.core.kv.manager import KVCacheManager, pages_for_budget
from deepserve.core.kv.store import StoreRegistry
from deepserve.core.plugins import collect_registrations, make_plugin_manager, select_backend
from deepserve.core.scheduler.cost_model import CostModelConfig, StepCostModel
from deepserve.core.scheduler.scheduler import Scheduler
from deepserve.core.structured import TokenizerInfo

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


@dataclass(slots=True)
class EngineParts:
    """What `build_engine` made. `engine` is the one object that steps; the rest are its parts, kept for
    callers that need them (the tokenizer and model config for prompts, the cache for tests and benchmarks).
    Once built, nothing here is replaced; the engine's thread owns the mutable state inside them."""

    config: EngineConfig
    plugin_manager: Any
    backend: Backend
    model: Any  # the torch model (`deepserve.model.deepseek_v4.DeepseekV4ForCausalLM` or a registered one)
    tokenizer: Any  # `deepserve.model.tokenizer.Tokenizer`, or None without tokenizer.json
    max_model_len: int
    proposer: Any
    kv_manager: KVCacheManager
    cache: Any  # `deepserve.model.kv_cache.PagedKVCache`
    cost_model: StepCostModel
    graphs: Any  # `deepserve.model.cuda_graphs.DecodeGraphs`, or None
    runner: Any  # `deepserve.model.runner.ModelRunner`
    engine: EngineCore
    block_stores: StoreRegistry  # the stores the plugins offer, by URI scheme


def resolve_config(model: Any = None, **options: Any) -> EngineConfig:
    """The engine's config from a model directory and options: the model defaults to `DEEPSERVE_MODEL` (or
    DeepInfer's `DEEPINFER_HF_MODEL_DIR`), else the embedded default model; `speculative_config` to
    `DEEPSERVE_SPECULATIVE_CONFIG`, `batch_invariant` to `DEEPSERVE_BATCH_INVARIANT`."""
    model = model if model is not None else default_model_dir()
    if model is None:
        raise ValueError("no model given: pass LLM(model=PATH) or set DEEPSERVE_MODEL (or DEEPINFER_HF_MODEL_DIR);"
                         " the embedded default model is not installed")
    if options.get("speculative_config") is None:
        options["speculative_config"] = env_value("DEEPSERVE_SPECULATIVE_CONFIG")
    if options.get("batch_invariant") is None:
        flag = env_value("DEEPSERVE_BATCH_INVARIANT")
        if flag is not None and flag.strip():
            if flag.strip() not in ("0", "1"):
                raise ValueError(f"DEEPSERVE_BATCH_INVARIANT must be 0 or 1, got {flag!r}")
            options["batch_invariant"] = flag.strip() == "1"
    return EngineConfig.from_options(model, **options)


def build_engine(config: EngineConfig, plugin_manager=None) -> EngineParts:
    """One engine from `config`; `plugin_manager` defaults to `make_plugin_manager(config.load_plugins)`."""
    from deepserve.model.cuda_graphs import DecodeGraphs
    from deepserve.model.factory import load_model
    from deepserve.model.kv_cache import PagedKVCache, bytes_per_page
    from deepserve.model.runner import ModelRunner
    from deepserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

    pm = plugin_manager if plugin_manager is not None else make_plugin_manager(load_entrypoints=config.load_plugins)
    backend = select_backend(pm, config)
    model = load_model(config.model, backend, config.dtype)
    cfg = model.cfg
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    tokenizer = Tokenizer(config.model, cfg) if (Path(config.model) / "tokenizer.json").is_file() else None
    proposer = _proposer(pm, config, model)

    block_size, max_num_seqs = config.block_size, config.max_num_seqs
    owners = model.default_state_owners + (tuple(proposer.state_owners) if proposer is not None else ())
    page_bytes = bytes_per_page(model, block_size, model.lm_head.weight.dtype, owners)
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else \
        _default_budget(backend, config.gpu_memory_utilization)
    num_pages = min(pages_for_budget(budget, page_bytes), max_num_seqs * math.ceil(max_model_len / block_size))
    kv_manager = KVCacheManager(num_pages, block_size, config.enable_prefix_caching)
    # the scratch region holds a step's new rows, so that prompt chunks take the batched path as well
    cache = PagedKVCache(model, num_pages, block_size, max_num_seqs, owners=owners,
                         max_step_tokens=max(config.max_num_batched_tokens, 16 * max_num_seqs))
    logger.info("KV cache: %d pages of %d tokens (%d tokens)", num_pages, block_size, num_pages * block_size)
    cost_model = StepCostModel(CostModelConfig(step_time_target=config.step_time_target))
    planner = proposer.planner if proposer is not None else None
    scheduler = Scheduler(kv_manager, cost_model, max_num_seqs, config.max_num_batched_tokens, max_model_len,
                          cfg.eos_token_ids, verify_planner=planner.plan if planner is not None else None)
    graphs = None
    if backend.cuda_graphs and not config.enforce_eager and proposer is None:
        graphs = DecodeGraphs(model, cache, max_num_seqs, math.ceil(max_model_len / block_size))
    decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer else None
    runner = ModelRunner(model, backend, cache, decode, proposer=proposer, graphs=graphs)
    detok = (lambda ids, skip: IncrementalDetokenizer(tokenizer, ids, skip)) if tokenizer else None
    spec = config.speculative_config
    engine = EngineCore(scheduler, runner, page_size=block_size, enable_prefix_caching=config.enable_prefix_caching,
                        make_detokenizer=detok, cost_model=cost_model, async_scheduling=config.async_scheduling,
                        seed=config.seed, grammars=_grammar_compiler(pm, config, model, tokenizer),
                        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                        verify_planner=planner)
    logger.info("deepserve: %s on %s (%s), max_model_len %d", config.model, backend.device, backend.name,
                max_model_len)
    stores = StoreRegistry(collect_registrations(pm, "deepserve_register_cache_backends"))
    return EngineParts(config, pm, backend, model, tokenizer, max_model_len, proposer, kv_manager, cache,
                       cost_model, graphs, runner, engine, stores)


def _proposer(pm, config: EngineConfig, model):
    """The speculative proposer that `config.speculative_config.method` names among the
    `deepserve_register_proposers` plugins, or None."""
    spec = config.speculative_config
    if spec is None:
        return None
    factories = collect_registrations(pm, "deepserve_register_proposers")
    if spec.method not in factories:
        raise ValueError(f"speculative_config.method {spec.method!r} is not a registered proposer; "
                         f"available: {sorted(factories)}")
    return factories[spec.method](model=model, config=spec, model_dir=str(config.model))


def _grammar_compiler(pm, config: EngineConfig, model, tokenizer) -> GrammarCompiler | None:
    """The structured-output compiler over the grammar backend plugins, or None without a tokenizer."""
    factories = collect_registrations(pm, "deepserve_register_grammar_backends")
    if tokenizer is None or not factories:
        return None
    cfg = model.cfg
    info = TokenizerInfo(tokenizer.to_str(), cfg.vocab_size, tuple(cfg.eos_token_ids) or tokenizer.eos_token_ids)
    compiler = GrammarCompiler(factories, info, config.structured_outputs_backend, config.grammar_compile_timeout,
                               max_workers=config.grammar_compile_workers)
    compiler.warm_up()  # the backend's tokenizer tables build on a worker thread, not in anyone's request
    return compiler


def _default_budget(backend: Backend, utilization: float) -> int:
    import torch

    device = torch.device(backend.device)
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    return max(int(free - (1 - utilization) * total), 0)
