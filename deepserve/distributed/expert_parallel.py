"""Expert parallelism on one rank: load only this rank's experts, and wire every MoE site to the transport.

`load_expert_parallel_model` reads the checkpoint with the loader's expert selection (each rank reads the
experts its placement slots name, replicas included, never the others'), builds the model with
`num_local_experts` slots per site, and logs the bytes the rank holds. `attach` then gives each `MoE` layer an
`ExpertParallelSite` (its site index, the placement and the transport) and returns the `RankExperts` that the
transport computes other ranks' rows with.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from deepserve.core.interfaces import Backend
from deepserve.model.factory import build_model, resolve_dtype
from deepserve.model.loader import load_weights, read_checkpoint, read_config
from deepserve.model.moe import MoE, expert_rows

from .placement import ExpertPlacement, PlacementError, site_index
from .transport import ExpertTransport

logger = logging.getLogger(__name__)


def moe_sites(model: torch.nn.Module) -> list[MoE]:
    """The model's MoE layers by site index (decoder layers, then MTP blocks)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            site = site_index(name, model.cfg.num_hidden_layers)
            if site is None:
                raise PlacementError(f"MoE module {name!r} is not at a known site (model.layers.N.mlp, mtp.N.mlp)")
            found[site] = module
    if sorted(found) != list(range(len(found))):
        raise PlacementError(f"MoE sites {sorted(found)} are not numbered 0..{len(found) - 1}")
    return [found[i] for i in range(len(found))]


def num_moe_sites(model_dir: str | os.PathLike, with_mtp: bool = True) -> int:
    cfg = read_config(model_dir)
    return cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)


def load_expert_parallel_model(model_dir: str | os.PathLike, backend: Backend, dtype, placement: ExpertPlacement,
                               rank: int, progress: bool = False):
    """The model with rank `rank`'s expert slots only (see the module docstring)."""
    cfg = read_config(model_dir)
    if placement.num_logical != cfg.n_routed_experts:
        raise PlacementError(f"the placement is for {placement.num_logical} experts, {model_dir} has "
                             f"{cfg.n_routed_experts}")
    torch_dtype = resolve_dtype(dtype, cfg, backend)

    def experts_of(prefix: str) -> list[int] | None:
        site = site_index(prefix, cfg.num_hidden_layers)
        if site is None or site >= placement.num_sites:
            raise PlacementError(f"checkpoint experts {prefix!r} have no row in the placement "
                                 f"({placement.num_sites} sites)")
        return placement.local_experts(site, rank)

    state = read_checkpoint(model_dir, dtype=torch_dtype, device=backend.device, progress=progress,
                            experts=experts_of)
    if cfg.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in state):
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    cfg = dataclasses.replace(cfg, num_local_experts=placement.num_local)
    model = build_model(cfg, backend, torch_dtype)
    load_weights(model, state)
    model.share_projection_inputs()
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    routed = sum(m.experts.gate_up_proj.nbytes + m.experts.down_proj.nbytes for m in moe_sites(model))
    logger.info("rank %d holds %.1f MiB of weights (%.1f MiB routed experts: %d slots per site of %d experts)",
                rank, held / 2**20, routed / 2**20, placement.num_local, cfg.n_routed_experts)
    return model


@dataclasses.dataclass
class RankExperts:
    """This rank's experts at every site (`deepserve.distributed.transport.LocalExperts`)."""

    backend: Backend
    sites: list[MoE]
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    def compute(self, site: int, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        moe = self.sites[site]
        return expert_rows(self.backend, rows, slots, moe.experts.gate_up_proj, moe.experts.down_proj, moe.limit)


@dataclasses.dataclass
class ExpertParallelSite:
    """One MoE layer's view of the transport (`deepserve.model.moe.ExpertParallelSite`). `loads` [sites,
    logical experts] (on the device), when given, counts the pairs routed to each expert (EPLB's statistics)."""

    site: int
    placement: ExpertPlacement
    transport: ExpertTransport
    loads: torch.Tensor | None = None

    def exchange(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.loads is not None:
            self.loads[self.site] += torch.bincount(ids.reshape(-1), minlength=self.loads.shape[1])
        return self.transport.exchange(self.site, x, self.placement.physical(self.site, ids))


def rank_experts(model, backend: Backend) -> RankExperts:
    return RankExperts(backend, moe_sites(model), model.cfg.hidden_size, model.lm_head.weight.dtype,
                       torch.device(backend.device))


def attach(model, placement: ExpertPlacement, transport: ExpertTransport, loads: torch.Tensor | None = None) -> None:
    """Give every MoE layer of `model` its site's handle on `transport` (counting into `loads` when given)."""
    sites = moe_sites(model)
    if len(sites) > placement.num_sites:
        raise PlacementError(f"the model has {len(sites)} MoE sites, the placement {placement.num_sites}")
    for i, moe in enumerate(sites):
        moe.enable_expert_parallel(ExpertParallelSite(i, placement, transport, loads))
