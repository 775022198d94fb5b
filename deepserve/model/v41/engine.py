"""`build_engine` for a V4.1 checkpoint (`model_type` `deepseek_v41`): the model, its paged states, the
runner, the DSpark proposer if asked, and the same KV manager, scheduler and `EngineCore` as V4's engine
(`deepserve.build`).

The states live in the KV manager's pages (`paged.V41PagedStates`: the kv sources' rows and index keys, and
each page's boundary snapshot for prefix hits; rings and open groups per sequence slot), as many pages as
`kv_cache_bytes` holds. Below the pages, V4's cache tiers (host memory, a block store) and KV events, which
`deepserve.build` hands in. `speculative_config` method `dspark` drafts with V4.1's DSpark blocks
(`plugins/speculative/dspark_v41.py`). The V4.1 path runs the reference's bf16 dataflow in torch ops, on the CPU
(bit for bit the reference's) or on a CUDA device (model, states and pages there; the FP8/FP4 weights in their
dense bf16 form, `numerics.QuantWeight.to`); SWA host slots hold V4.1's own state (`swa_slots.py`); options it
does not have yet (scale-out, tensor parallelism) are refused by name.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepserve.core.config import EngineConfig
from deepserve.core.engine import EngineCore
from deepserve.core.env import gc_freeze_wanted
from deepserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class V41EngineCore(EngineCore):
    """`EngineCore` that refuses image tokens at admission (text only until the vision-encoder role)."""

    def __init__(self, *args, image_token_id: int = -1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.image_token_id = image_token_id

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *args, **kwargs) -> None:
        if self.image_token_id >= 0 and self.image_token_id in prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt holds the image token {self.image_token_id}; V4.1 "
                             "image inputs need the vision tower (the vision-encoder role), which deepserve does "
                             "not have yet: text only")
        super().add_request(request_id, prompt_token_ids, params, *args, **kwargs)


def _refuse_unsupported(config: EngineConfig, device: torch.device) -> None:
    refused = {
        "data_parallel_size / enable_expert_parallel": config.distributed,
        "tensor_parallel_size": config.tensor_parallel_size != 1,
    }
    named = [k for k, on in refused.items() if on]
    if named:
        raise ValueError(f"the V4.1 engine path does not take {', '.join(named)} yet")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the V4.1 engine path runs on the CPU or a CUDA device, not {device.type}")
    if config.dtype not in ("auto", "bfloat16"):
        raise ValueError(f"dtype {config.dtype!r}: V4.1 runs the reference's bf16 dataflow over its stored "
                         "FP8/FP4 weights (dtype 'auto' or 'bfloat16')")


@dataclass(slots=True)
class V41Engine:
    """What `build_v41_engine` made (`deepserve.build` wraps it in its `EngineParts`)."""

    model: Any  # DeepseekV41ForCausalLM
    tokenizer: Any  # deepserve.model.tokenizer.Tokenizer, or None
    max_model_len: int
    proposer: Any  # V41DSparkProposer, or None
    kv_manager: Any  # deepserve.core.kv.manager.KVCacheManager
    states: Any  # paged.V41PagedStates
    cost_model: Any
    runner: Any  # runner.V41ModelRunner
    engine: V41EngineCore


def build_v41_engine(config: EngineConfig, backend, make_proposer: Callable, make_grammars: Callable,
                     default_kv_cache_bytes: int, emit: Callable | None = None,
                     make_tiers: Callable | None = None) -> V41Engine:
    """The engine of a V4.1 checkpoint directory `config.model` on `backend`, for `deepserve.build.build_engine`,
    which passes its choices in: `make_proposer(model)` (None without `speculative_config`),
    `make_grammars(model, tokenizer)` (the structured-output compiler, or None), the KV budget to use
    without `kv_cache_bytes`, the KV manager's event sink `emit` (KV events) and `make_tiers(model, states,
    runner)`: the cache tiers below the pages, their SWA replay and the SWA host slots, as `EngineCore`
    keywords."""
    from deepserve.core.kv.manager import KVCacheManager, pages_for_budget
    from deepserve.core.scheduler.cost_model import CostModelConfig, StepCostModel
    from deepserve.core.scheduler.scheduler import Scheduler
    from deepserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

    from .loader import load_v41
    from .paged import V41PagedStates, bytes_per_page
    from .runner import V41ModelRunner

    _refuse_unsupported(config, torch.device(backend.device))
    device = torch.device(backend.device)
    model = load_v41(config.model, engram_device=config.engram_device)  # "cpu": the tables stay in host memory
    if device.type != "cpu":
        model.to_device(device)
    cfg = model.cfg
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    tokenizer = Tokenizer(config.model, cfg) if (Path(config.model) / "tokenizer.json").is_file() else None
    proposer = make_proposer(model)

    block_size, max_num_seqs = config.block_size, config.max_num_seqs
    owners = model.state_owners()
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else default_kv_cache_bytes
    num_pages = min(pages_for_budget(budget, bytes_per_page(owners, block_size)),
                    max_num_seqs * math.ceil(max_model_len / block_size))
    kv_manager = KVCacheManager(num_pages, block_size, config.enable_prefix_caching, emit=emit)
    states = V41PagedStates(owners, max_num_seqs, num_pages, block_size, device=device)
    cost_model = StepCostModel(CostModelConfig(step_time_target=config.step_time_target))
    planner = proposer.planner if proposer is not None else None
    scheduler = Scheduler(kv_manager, cost_model, max_num_seqs, config.max_num_batched_tokens, max_model_len,
                          cfg.eos_token_ids, verify_planner=planner.plan if planner is not None else None)
    decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer else None
    runner = V41ModelRunner(model, backend, states, decode, proposer=proposer)
    detok = (lambda ids, skip: IncrementalDetokenizer(tokenizer, ids, skip)) if tokenizer else None
    engine = V41EngineCore(scheduler, runner, page_size=block_size, enable_prefix_caching=config.enable_prefix_caching,
                           make_detokenizer=detok, cost_model=cost_model, async_scheduling=config.async_scheduling,
                           seed=config.seed, grammars=make_grammars(model, tokenizer),
                           num_speculative_tokens=proposer.num_speculative_tokens if proposer else 0,
                           verify_planner=planner, image_token_id=cfg.image_token_id, freeze_gc=gc_freeze_wanted(),
                           **(make_tiers(model, states, runner) if make_tiers is not None else {}))
    logger.info("deepserve: %s (V4.1) on %s, max_model_len %d, %d pages of %d tokens", config.model,
                backend.device, max_model_len, num_pages, block_size)
    return V41Engine(model, tokenizer, max_model_len, proposer, kv_manager, states, cost_model, runner, engine)
