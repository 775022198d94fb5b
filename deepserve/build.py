"""The composition root: `build_engine(config)` assembles one engine from an `EngineConfig` and the plugin manager.

`LLM`, `AsyncEngine.from_pretrained`, the server and (next) each rank process all build through here, so an
engine is put together in one way: backend (chosen by the plugin hooks), model (by the registry's
`model_type`), tokenizer, speculative proposer, paged KV cache sized from a memory budget, KV manager with
prefix caching, scheduler with cost-model chunked prefill, CUDA graphs where the backend has them, model
runner, grammar compiler, the block stores the plugins offer, and the `EngineCore` that steps them. It lives outside `deepserve.core`, which it
imports, so that `core` stays importable without torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepserve.core.config import EngineConfig
from deepserve.core.engine import EngineCore
from deepserve.core.env import default_model_dir, env_value, gc_freeze_wanted
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
    kv_events: Any = None  # `plugins.cache.kv_events.ZmqEventPublisher` with kv_events_config on, else None


def resolve_config(model: Any = None, **options: Any) -> EngineConfig:
    """The engine's config from a model directory and options: the model defaults to `DEEPSERVE_MODEL` (or
    DeepInfer's `DEEPINFER_HF_MODEL_DIR`), else the embedded default model; `speculative_config` to
    `DEEPSERVE_SPECULATIVE_CONFIG`, `batch_invariant` to `DEEPSERVE_BATCH_INVARIANT`, `engine_process` to
    `DEEPSERVE_ENGINE_PROCESS`."""
    model = model if model is not None else default_model_dir()
    if model is None:
        raise ValueError("no model given: pass LLM(model=PATH) or set DEEPSERVE_MODEL (or DEEPINFER_HF_MODEL_DIR);"
                         " the embedded default model is not installed")
    if options.get("speculative_config") is None:
        options["speculative_config"] = env_value("DEEPSERVE_SPECULATIVE_CONFIG")
    for name in ("batch_invariant", "engine_process"):
        flag = env_value(f"DEEPSERVE_{name.upper()}") if options.get(name) is None else None
        if flag is not None and flag.strip():
            if flag.strip() not in ("0", "1"):
                raise ValueError(f"DEEPSERVE_{name.upper()} must be 0 or 1, got {flag!r}")
            options[name] = flag.strip() == "1"
    if options.get("engine_process", False) is None:
        del options["engine_process"]  # (None: not given)
    return EngineConfig.from_options(model, **options)


def build_engine(config: EngineConfig, plugin_manager=None, *, rank=None, group=None) -> EngineParts:
    """One engine from `config`; `plugin_manager` defaults to `make_plugin_manager(config.load_plugins)`.

    With `data_parallel_size` > 1 or `enable_expert_parallel` (and no `rank`), the engine is the data-parallel
    front (`deepserve.distributed.front.DataParallelEngine`): this starts the ranks and returns once they are
    ready. With `engine_process` alone it is that front over one engine in its own process
    (`deepserve.distributed.engine_process`). A rank process calls it with its `rank`
    (`deepserve.distributed.launch.RankContext`) and, under expert parallelism, the ranks' process `group`: then
    the model holds this rank's experts only and the runner steps in lockstep with the other ranks
    (`deepserve.distributed.rank`)."""
    from deepserve.model.cuda_graphs import DecodeGraphs
    from deepserve.model.factory import load_model
    from deepserve.model.kv_cache import PagedKVCache, bytes_per_page
    from deepserve.model.kv_precision import use_kv_cache_dtype
    from deepserve.model.registry import checkpoint_model_type
    from deepserve.model.runner import ModelRunner
    from deepserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
    from deepserve.model.warm_up import wanted as warm_up_wanted

    pm = plugin_manager if plugin_manager is not None else make_plugin_manager(load_entrypoints=config.load_plugins)
    if config.in_engine_process and rank is None:
        return _build_engine_process(config, pm)
    model_type = checkpoint_model_type(config.model)
    if model_type == "deepseek_v41":
        if config.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} is built for DeepSeek-V4 checkpoints; a V4.1 "
                             "checkpoint's cache keeps the model dtype (kv_cache_dtype='auto')")
        return _build_v41(config, pm)
    if config.engram_device is not None:
        raise ValueError(f"engram_device places the Engram tables of a DeepSeek-V4.1 checkpoint (model_type "
                         f"deepseek_v41); {config.model} has model_type {model_type!r}, which has none")
    if config.distributed and rank is None:
        return _build_front(config, pm)
    backend = select_backend(pm, config)
    placement = None
    if rank is not None and config.enable_expert_parallel:
        from deepserve.distributed.expert_parallel import load_expert_parallel_model

        placement = expert_placement(config, rank.world_size)
        model = load_expert_parallel_model(config.model, backend, config.dtype, placement, rank.rank)
    else:
        model = load_model(config.model, backend, config.dtype, quantization=config.quantization)
    use_kv_cache_dtype(model, config.kv_cache_dtype)  # the rounding of the KV rows (docs/quantization.md)
    cfg = model.cfg
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    tokenizer = Tokenizer(config.model, cfg) if (Path(config.model) / "tokenizer.json").is_file() else None
    proposer = _proposer(pm, config, model)

    block_size, max_num_seqs = config.block_size, config.max_num_seqs
    owners = model.default_state_owners + (tuple(proposer.state_owners) if proposer is not None else ())
    page_bytes = bytes_per_page(model, block_size, model.lm_head.weight.dtype, owners, model.kv_precision)
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else \
        _default_budget(backend, config.gpu_memory_utilization)
    num_pages = min(pages_for_budget(budget, page_bytes), max_num_seqs * math.ceil(max_model_len / block_size))
    kv_events = _kv_events(config, rank)
    kv_manager = KVCacheManager(num_pages, block_size, config.enable_prefix_caching,
                                emit=kv_events.emit if kv_events is not None else None)
    # the scratch region holds a step's new rows, so that prompt chunks take the batched path as well
    cache = PagedKVCache(model, num_pages, block_size, max_num_seqs, owners=owners,
                         max_step_tokens=max(config.max_num_batched_tokens, 16 * max_num_seqs))
    logger.info("KV cache: %d pages of %d tokens (%d tokens), kv_cache_dtype %s (%d bytes a page, as stored)",
                num_pages, block_size, num_pages * block_size, config.kv_cache_dtype, page_bytes)
    cost_model = StepCostModel(CostModelConfig(step_time_target=config.step_time_target))
    planner = proposer.planner if proposer is not None else None
    scheduler = Scheduler(kv_manager, cost_model, max_num_seqs, config.max_num_batched_tokens, max_model_len,
                          cfg.eos_token_ids, verify_planner=planner.plan if planner is not None else None)
    graphs = None
    # the built-in transport reads counts on the host each exchange: no CUDA graph can hold a step through it
    if backend.cuda_graphs and not config.enforce_eager and proposer is None and placement is None:
        graphs = DecodeGraphs(model, cache, max_num_seqs, math.ceil(max_model_len / block_size),
                              batch_sizes=config.cuda_graph_sizes)
        if graphs.capture:  # compile and capture every bucket now: no request pays for it
            graphs.warm_up()
    verify_graphs = None
    if backend.cuda_graphs and not config.enforce_eager and proposer is not None and placement is None and \
            cache.layers and cache.layers[0].storage.is_cuda:
        # the drafter's fixed-shape work (the MTP chain) as its own graphs, and the target's verify steps (up to
        # k drafts a sequence, fewer padded up to k), now
        proposer.capture_graphs(cache, max_num_seqs, batch_sizes=config.cuda_graph_sizes)
        verify_graphs = _verify_graphs(model, cache, config, max_num_seqs, math.ceil(max_model_len / block_size))
    decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer else None
    runner = ModelRunner(model, backend, cache, decode, proposer=proposer, graphs=graphs, verify_graphs=verify_graphs)
    runner.page_snapshots = config.enable_prefix_caching
    if placement is None and warm_up_wanted(config.warm_up, backend.device):  # (ranks in lockstep: not alone)
        # every other step kind (prompt chunks by size, after a prefix, mixed, verify) compiled now, on scratch state
        spec = config.speculative_config
        runner.warm_up(kv_manager, config.max_num_batched_tokens, max_model_len,
                       spec.num_speculative_tokens if spec else 0)
    executor = runner
    if placement is not None:
        executor = _lockstep(pm, config, runner, placement, group)
    detok = (lambda ids, skip: IncrementalDetokenizer(tokenizer, ids, skip)) if tokenizer else None
    spec = config.speculative_config
    # ranks in lockstep run each step's forward (and its exchanges) inside step(): see deepserve.distributed.rank
    async_scheduling = config.async_scheduling and placement is None
    engine = EngineCore(scheduler, executor, page_size=block_size, enable_prefix_caching=config.enable_prefix_caching,
                        make_detokenizer=detok, cost_model=cost_model, async_scheduling=async_scheduling,
                        seed=config.seed, grammars=_grammar_compiler(pm, config, model, tokenizer),
                        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                        verify_planner=planner, **_kv_tiers(pm, config, model, cache),
                        **_swa_slots(config, cache, runner, proposer, placement), **_swa_replay(config, cache, runner),
                        freeze_gc=gc_freeze_wanted())
    logger.info("deepserve: %s on %s (%s), max_model_len %d", config.model, backend.device, backend.name,
                max_model_len)
    stores = StoreRegistry(collect_registrations(pm, "deepserve_register_cache_backends"))
    return EngineParts(config, pm, backend, model, tokenizer, max_model_len, proposer, kv_manager, cache,
                       cost_model, graphs, runner, engine, stores, kv_events)


def _build_v41(config: EngineConfig, pm) -> EngineParts:
    """A V4.1 checkpoint's engine (docs/v41.md), assembled by `deepserve.model.v41.engine` with this module's
    proposer and grammar-compiler choices, KV events publisher, cache tiers (`_v41_tiers`) and SWA host slots
    (`_v41_swa_slots`)."""
    from deepserve.model.v41.engine import build_v41_engine

    backend = select_backend(pm, config)
    kv_events = _kv_events(config, None)

    def make_tiers(model, states, runner) -> dict:
        return {**_v41_tiers(pm, config, model, states, runner), **_v41_swa_slots(config, states, runner)}

    try:
        v41 = build_v41_engine(config, backend, lambda model: _proposer(pm, config, model),
                               lambda model, tokenizer: _grammar_compiler(pm, config, model, tokenizer),
                               DEFAULT_CPU_KV_CACHE_BYTES, emit=kv_events.emit if kv_events is not None else None,
                               make_tiers=make_tiers)
    except BaseException:  # a refused option, say: the publisher's socket and thread go with the engine
        if kv_events is not None:
            kv_events.close()
        raise
    stores = StoreRegistry(collect_registrations(pm, "deepserve_register_cache_backends"))
    return EngineParts(config, pm, backend, v41.model, v41.tokenizer, v41.max_model_len, v41.proposer,
                       v41.kv_manager, v41.states, v41.cost_model, None, v41.runner, v41.engine, stores, kv_events)


def expert_placement(config: EngineConfig, world_size: int):
    """The expert placement of `config`: `expert_placement` (a `phy2log` array-like [sites, physical], or a JSON
    file of one; a table of the decoder layers only gets the static rows for the MTP sites), else the static one
    with `num_redundant_experts` copies."""
    import json

    from deepserve.distributed.expert_parallel import num_moe_sites
    from deepserve.distributed.placement import ExpertPlacement
    from deepserve.model.loader import read_config

    cfg = read_config(config.model)
    sites = num_moe_sites(config.model)
    table = config.expert_placement
    if table is None and config.enable_eplb:  # EPLB's own start: its placement for uniform loads
        from deepserve.core.balance.placement import Placement

        table = Placement.from_loads([[1.0] * cfg.n_routed_experts] * sites, world_size,
                                     config.num_redundant_experts).phy2log
    if table is None:
        return ExpertPlacement.uniform(sites, cfg.n_routed_experts, world_size, config.num_redundant_experts)
    if isinstance(table, (str, Path)):
        table = json.loads(Path(table).read_text())
    rows = [list(row) for row in table]
    if len(rows) == cfg.num_hidden_layers < sites:
        static = ExpertPlacement.uniform(sites - len(rows), cfg.n_routed_experts, world_size,
                                         len(rows[0]) - cfg.n_routed_experts)
        rows += static.phy2log.tolist()
    return ExpertPlacement.from_phy2log(rows, cfg.n_routed_experts, world_size)


def _lockstep(pm, config: EngineConfig, runner, placement, group):
    """The rank's runner wrapped to step with the others, through the transport `config.expert_transport`."""
    from deepserve.distributed.expert_parallel import attach, rank_experts
    from deepserve.distributed.rank import LockstepExecutor

    factories = collect_registrations(pm, "deepserve_register_expert_transports")
    if config.expert_transport not in factories:
        raise ValueError(f"expert_transport {config.expert_transport!r} is not a registered transport; "
                         f"available: {sorted(factories)}")
    transport = factories[config.expert_transport](group, placement, rank_experts(runner.model, runner.backend))
    if not config.enable_eplb:
        attach(runner.model, placement, transport)
        return LockstepExecutor(runner, transport)
    import torch

    from deepserve.core.balance.expert_balancer import EplbConfig, ExpertLoadBalancer
    from deepserve.distributed.eplb import RankBalancer, as_balance_placement
    from deepserve.distributed.expert_parallel import moe_sites

    loads = torch.zeros(placement.num_sites, placement.num_logical, dtype=torch.int64,
                        device=torch.device(runner.backend.device))
    attach(runner.model, placement, transport, loads)
    eplb = EplbConfig(config.eplb_window_size, config.eplb_step_interval,
                      config.num_redundant_experts // placement.world_size)
    balancer = ExpertLoadBalancer(eplb, placement.num_sites, placement.num_logical, placement.world_size,
                                  initial=as_balance_placement(placement))
    return LockstepExecutor(runner, transport, RankBalancer(balancer, moe_sites(runner.model), transport, group,
                                                            loads))


def _verify_graphs(model, cache, config: EngineConfig, max_num_seqs: int, max_pages: int):
    """The verify steps of `num_speculative_tokens` drafts a sequence as CUDA graphs, every bucket captured now;
    None (verify steps run eagerly) for a proposer that drafts no fixed number or a width past the window."""
    from deepserve.model.verify_graphs import VerifyGraphs

    spec = config.speculative_config
    k = spec.num_speculative_tokens if spec is not None else 0
    try:
        graphs = VerifyGraphs(model, cache, max_num_seqs, max_pages, 1 + k, batch_sizes=config.cuda_graph_sizes)
    except ValueError as exc:
        logger.info("verify steps run eagerly: %s", exc)
        return None
    graphs.warm_up()
    return graphs


def _kv_events(config: EngineConfig, rank):
    """The KV events publisher `kv_events_config` asks for (vLLM's shape), or None. A data-parallel rank
    publishes with its rank, on the endpoint's port plus its rank, as vLLM's ranks do."""
    events = config.kv_events_config
    if events is None or not events.enabled:
        return None
    from deepserve.plugins.cache.kv_events import ZmqEventPublisher

    if rank is not None:
        head, sep, port = events.endpoint.rpartition(":")
        if sep and port.isdigit():
            events = dataclasses.replace(events, endpoint=f"{head}:{int(port) + rank.rank}")
    return ZmqEventPublisher(events, data_parallel_rank=rank.rank if rank is not None else None)


def _kv_tiers(pm, config: EngineConfig, model, cache) -> dict:
    """The engine's cache tiers below the GPU pages (`host_cache_bytes`, `kv_store`) and the page copies they
    go through, as `EngineCore` keywords; none without either option. docs/cache.md."""
    if config.host_cache_bytes is None and config.kv_store is None:
        return {}
    from deepserve.model.kv_cache import page_pool_bytes, read_pages, write_pages

    if not config.kv_store_snapshots and len(cache.pools) > 1:  # a drafter's state owner is allocated too
        raise ValueError("kv_store_snapshots=False replays the main layers' window state only: not with a "
                         "speculative drafter's state")
    pool_bytes = page_pool_bytes(cache)
    namespace = kv_namespace(config, model, cache.page_size, pool_bytes)
    return _tiers_over(pm, config, cache.page_size, pool_bytes, namespace, _PageIO(cache, read_pages, write_pages))


def _tiers_over(pm, config: EngineConfig, page_size: int, pool_bytes: dict[str, int], namespace: str, page_io) -> dict:
    """The host tier and the store `config` asks for, over pages of `pool_bytes` (a model's pools) copied through
    `page_io`, as `EngineCore` keywords. Without window snapshots the store keeps every pool but the
    `*.snapshot` ones."""
    from deepserve.core.kv.store import GuardedStore
    from deepserve.core.kv.tiers import HostTier, KVTiers

    store = None
    if config.kv_store is not None:
        registry = StoreRegistry(collect_registrations(pm, "deepserve_register_cache_backends"))
        store = GuardedStore(registry.open(config.kv_store), config.kv_store_deadline)
    host = HostTier(config.host_cache_bytes) if config.host_cache_bytes is not None else None
    logger.info("KV cache tiers: host %s, store %s (namespace %s)",
                f"{config.host_cache_bytes} bytes" if host else "none", config.kv_store or "none", namespace)
    store_pools = None if config.kv_store_snapshots else [p for p in pool_bytes if not p.endswith(".snapshot")]
    return dict(kv_tiers=KVTiers(namespace, pool_bytes, page_size, host, store, config.kv_store_ttl_class,
                                 store_pools), page_io=page_io)


def _v41_tiers(pm, config: EngineConfig, model, states, runner) -> dict:
    """A V4.1 engine's cache tiers (V4's, over `V41PagedStates.page_pools`, in a namespace of V4.1's KV layout)
    and, with a store that keeps no window snapshots, the SWA replay of a hit's last page by V4.1's
    `replay.replay_state` (`exact`: window x depth tokens; `bounded`: 128), as `EngineCore` keywords; none
    without `host_cache_bytes` or `kv_store`. docs/v41.md."""
    if config.host_cache_bytes is None and config.kv_store is None:
        return {}
    import functools

    from deepserve.model.v41.paged import page_pool_bytes, read_pages, write_pages
    from deepserve.model.v41.replay import BOUNDED_LENGTH, exact_length

    if not config.kv_store_snapshots and config.speculative_config is not None:
        raise ValueError("kv_store_snapshots=False replays the V4.1 backbone's state only: not with DSpark's rings")
    pool_bytes = page_pool_bytes(states)
    namespace = kv_namespace(config, model, states.page_size, pool_bytes, layout="v41-paged-1", dtype="bfloat16")
    out = _tiers_over(pm, config, states.page_size, pool_bytes, namespace, _PageIO(states, read_pages, write_pages))
    if not config.kv_store_snapshots:
        length = BOUNDED_LENGTH if config.swa_replay == "bounded" else exact_length(model.cfg)
        logger.info("SWA replay (V4.1): %s, %d tokens per prefix whose window snapshot is not stored",
                    config.swa_replay, length)
        out.update(replay_snapshot=functools.partial(runner.replay_snapshot, length=length),
                   swa_replay_mode=config.swa_replay)
    return out


def _v41_swa_slots(config: EngineConfig, states, runner) -> dict:
    """A V4.1 engine's SWA host slots (`swa_host_slots`): V4's pool and directory over V4.1's payload, the state
    past the last full page kept exactly (`deepserve.model.v41.swa_slots`), as `EngineCore` keywords; none without
    it. With DSpark too: the drafter's rings and count travel in the slot. docs/v41.md."""
    if config.swa_host_slots is None:
        return {}
    import socket

    from deepserve.core.kv.swa_slots import SWASlots
    from deepserve.model.v41.swa_slots import slot_bytes, slot_layout

    size = slot_bytes(states)
    logger.info("SWA host slots (V4.1): %d of %d bytes (%.1f MiB)", config.swa_host_slots, size,
                config.swa_host_slots * size / 2**20)
    return dict(swa_slots=SWASlots(config.swa_host_slots, size, states.page_size, slot_layout(states),
                                   socket.gethostname()), slot_io=runner)


def _swa_slots(config: EngineConfig, cache, runner, proposer, placement) -> dict:
    """The SWA host slots `swa_host_slots` asks for (a pool of MXFP8 slots sized from the model's declared window
    state, and its session directory), as `EngineCore` keywords; none without it. docs/cache.md."""
    if config.swa_host_slots is None:
        return {}
    if proposer is not None or placement is not None:
        raise ValueError("swa_host_slots are not supported with speculative decoding or expert parallelism "
                         "(the drafter's state lags one token; ranks step in lockstep)")
    import socket

    from deepserve.core.kv.swa_slots import SWASlots
    from deepserve.model.swa_slots import slot_bytes, slot_layout

    size = slot_bytes(cache)
    logger.info("SWA host slots: %d of %d bytes (%.1f MiB)", config.swa_host_slots, size,
                config.swa_host_slots * size / 2**20)
    return dict(swa_slots=SWASlots(config.swa_host_slots, size, cache.page_size, slot_layout(cache),
                                   socket.gethostname()), slot_io=runner)


def _swa_replay(config: EngineConfig, cache, runner) -> dict:
    """The SWA replay of prefixes whose window snapshots the store does not keep (`kv_store_snapshots=False`),
    `swa_replay` tokens long (`exact`: window x depth; `bounded`: 128), as `EngineCore` keywords. docs/cache.md."""
    if config.kv_store_snapshots:
        return {}
    import functools

    from deepserve.model.swa_replay import BOUNDED_LENGTH, exact_length

    length = BOUNDED_LENGTH if config.swa_replay == "bounded" else exact_length(cache)
    logger.info("SWA replay: %s, %d tokens per prefix whose window snapshot is not stored", config.swa_replay, length)
    return dict(replay_snapshot=functools.partial(runner.replay_snapshot, length=length),
                swa_replay_mode=config.swa_replay)


@dataclass(frozen=True, slots=True)
class _PageIO:
    """`EngineCore`'s `PageIO` over the paged cache."""

    cache: Any
    read_pages: Any
    write_pages: Any

    def read(self, pages):
        return self.read_pages(self.cache, pages)

    def write(self, pages, blocks) -> None:
        self.write_pages(self.cache, pages, blocks)


def kv_namespace(config: EngineConfig, model, page_size: int, pool_bytes: dict[str, int], *,
                 layout: str = "v4-paged-1", dtype: str | None = None) -> str:
    """The block stores' namespace of this engine's KV bytes: the model directory's name; the weights' revision (a
    digest of config.json and of each safetensors file's size, header and first and last MiB, so retrained
    weights of the same shapes differ, and so do copies of the checkpoint only where their bytes do); the KV
    layout (`layout`, the model family's page format: V4's `v4-paged-1`, V4.1's `v41-paged-1`; page size and
    every pool's bytes per page); the KV dtype (`dtype`, else V4's from `kv_cache_dtype` and the weights); shard 0
    (one engine holds every layer)."""
    import hashlib

    from deepserve.core.kv.store import StoreNamespace

    root = Path(config.model)
    digest = hashlib.sha256((root / "config.json").read_bytes() if (root / "config.json").is_file() else b"")
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
            head = f.read(min(header + 2**20, size - 8))
            f.seek(max(size - 2**20, 8 + len(head)))
            tail = f.read()
        digest.update(path.name.encode() + size.to_bytes(8, "little") + head + tail)
    pools = hashlib.sha256(repr(sorted(pool_bytes.items())).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in root.name) or "model"
    # the precision of the values the pages hold (their storage width is in the layout's bytes per pool)
    if dtype is None:
        dtype = {"fp8": "fp8_e4m3", "bf16": "bfloat16"}.get(config.kv_cache_dtype,
                                                           str(model.lm_head.weight.dtype).removeprefix("torch."))
    return StoreNamespace(name, digest.hexdigest()[:16], f"{layout}-p{page_size}-{pools}", dtype).key


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


# -- scale-out: the front and the rank processes --------------------------------------------------------------
def _build_front(config: EngineConfig, pm) -> EngineParts:
    """Start this machine's ranks and the front that drives them (see `build_engine`)."""
    from deepserve.distributed.front import DataParallelEngine, RemoteModel, bind_router
    from deepserve.distributed.launch import free_port, rank_contexts, start_ranks
    from deepserve.model.loader import read_config
    from deepserve.model.tokenizer import Tokenizer

    routers = collect_registrations(pm, "deepserve_register_dp_routers")
    if config.data_parallel_router not in routers:
        raise ValueError(f"data_parallel_router {config.data_parallel_router!r} is not a registered policy; "
                         f"available: {sorted(routers)}")
    cfg = read_config(config.model)
    if config.enable_expert_parallel:
        expert_placement(config, config.data_parallel_size)  # refuse an impossible placement before any start
    port = config.data_parallel_rpc_port or free_port(config.data_parallel_address)
    socket = bind_router(f"tcp://{config.data_parallel_address}:{port}")
    processes = start_ranks(serve_rank, config, rank_contexts(config, port))
    grammars = None
    try:
        tokenizer = Tokenizer(config.model, cfg) if (Path(config.model) / "tokenizer.json").is_file() else None
        # constrained requests are validated on the front's own compiler, then compiled again on their rank
        grammars = _grammar_compiler(pm, config, RemoteModel(cfg), tokenizer)
        engine = DataParallelEngine(socket, config.data_parallel_size, routers[config.data_parallel_router](
            config.data_parallel_size), processes, vocab_size=cfg.vocab_size,
            start_timeout=config.data_parallel_timeout, grammars=grammars)
    except BaseException:
        for proc in processes:
            proc.kill()
        socket.close(linger=0)
        if grammars is not None:
            grammars.shutdown()
        raise
    logger.info("deepserve: %s on %d data-parallel ranks%s, rank weights %s MiB", config.model,
                config.data_parallel_size, " with expert parallelism" if config.enable_expert_parallel else "",
                [round(b / 2**20, 1) for b in engine.weight_bytes])
    stores = StoreRegistry(collect_registrations(pm, "deepserve_register_cache_backends"))
    return EngineParts(config, pm, None, RemoteModel(cfg), tokenizer, engine.max_model_len, None, None, None, None,
                       None, None, engine, stores)


def serve_rank(config: EngineConfig, context) -> None:
    """A rank process's body (`deepserve.distributed.launch.start_ranks` spawns it): join the group, build this
    rank's engine, tell the front it is ready, and run the rank loop until the front says stop."""
    import functools
    import signal

    import torch

    from deepserve.distributed.rank import serve

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {context.rank} %(levelname)s %(message)s")
    # Ctrl-C (or a supervisor's SIGTERM) reaches the whole process group: the front drains and then stops the
    # ranks itself, so a rank must not die under it; a rank whose front is gone stops on its own (RankLoop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.device is None and context.dist_backend == "nccl":
        config = dataclasses.replace(config, device=f"cuda:{context.local_index}")
    try:
        serve(context, functools.partial(_rank_engine, config, context))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _rank_engine(config: EngineConfig, context):
    """A rank's engine (`deepserve.distributed.rank.RankEngine`): under expert parallelism it joins the ranks'
    group first and steps in lockstep with them."""
    from deepserve.distributed.launch import init_process_group
    from deepserve.distributed.rank import LockstepExecutor, RankEngine

    group = init_process_group(context) if config.enable_expert_parallel else None
    parts = build_engine(config, rank=context, group=group)
    executor = parts.engine.executor
    return RankEngine(parts.engine, parts.max_model_len, config.max_num_seqs, _weight_bytes(parts.model),
                      str(parts.backend.device), group, executor if isinstance(executor, LockstepExecutor) else None)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _build_engine_process(config: EngineConfig, pm) -> EngineParts:
    """The front over one engine in its own process (`engine_process`; see `build_engine`). The front keeps what
    the caller reads of the model: its config, tokenizer and a grammar compiler that validates constrained
    requests (the engine compiles them again, as a rank does)."""
    import functools

    from deepserve.distributed.engine_process import start_engine_process
    from deepserve.distributed.front import RemoteModel
    from deepserve.model.registry import checkpoint_model_type
    from deepserve.model.tokenizer import Tokenizer

    if checkpoint_model_type(config.model) == "deepseek_v41":
        from deepserve.model.v41.config import V41Config

        cfg = V41Config.from_dir(config.model)
    else:
        from deepserve.model.loader import read_config

        cfg = read_config(config.model)
    tokenizer = Tokenizer(config.model, cfg) if (Path(config.model) / "tokenizer.json").is_file() else None
    grammars = _grammar_compiler(pm, config, RemoteModel(cfg), tokenizer)
    try:
        engine = start_engine_process(functools.partial(engine_process_engine, config), vocab_size=cfg.vocab_size,
                                      grammars=grammars, timeout=config.data_parallel_timeout)
    except BaseException:
        if grammars is not None:
            grammars.shutdown()
        raise
    logger.info("deepserve: %s in an engine process (pid %d)", config.model, engine.processes[0].pid)
    stores = StoreRegistry(collect_registrations(pm, "deepserve_register_cache_backends"))
    return EngineParts(config, pm, None, RemoteModel(cfg), tokenizer, engine.max_model_len, None, None, None, None,
                       None, None, engine, stores)


def engine_process_engine(config: EngineConfig):
    """The engine process's engine (`deepserve.distributed.rank.RankEngine`): `config`'s engine, built as in one
    process (`build_engine` without `engine_process`)."""
    from deepserve.distributed.rank import RankEngine

    parts = build_engine(dataclasses.replace(config, engine_process=False))
    weights = _weight_bytes(parts.model) if hasattr(parts.model, "state_dict") else 0
    return RankEngine(parts.engine, parts.max_model_len, config.max_num_seqs, weights, str(parts.backend.device))


def run_headless(config: EngineConfig) -> None:
    """`deepserve serve --headless`: start this machine's ranks of a multi-node deployment (whose front runs on
    another machine, at `data_parallel_address:data_parallel_rpc_port`) and wait for them to end. Under
    `torchrun` this process is one rank (torchrun's RANK / WORLD_SIZE / LOCAL_RANK and rendezvous) and runs it."""
    from deepserve.distributed.launch import rank_contexts, start_ranks, torchrun_context

    context = torchrun_context(config)
    if context is not None:
        serve_rank(config, context)
        return
    if config.data_parallel_rpc_port is None:
        raise ValueError("--headless needs --data-parallel-rpc-port (and --data-parallel-address): the front's port")
    processes = start_ranks(serve_rank, config, rank_contexts(config, config.data_parallel_rpc_port))
    try:
        for proc in processes:
            proc.join()
    finally:  # interrupted here: the ranks ignore SIGINT / SIGTERM (the front stops them), so they are killed
        for proc in processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    failed = [p.name for p in processes if p.exitcode]
    if failed:
        raise RuntimeError(f"rank process(es) {failed} ended with an error")
