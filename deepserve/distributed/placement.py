"""Where each routed expert lives under expert parallelism: a table from logical experts (the checkpoint's) to
physical experts (the slots ranks hold), per MoE site.

A model has `num_sites` MoE sites: its decoder layers in order, then the MTP blocks' (`site_names`). Each site
has `num_physical` slots, `num_physical / world_size` per rank: rank r holds slots
`[r * per_rank, (r + 1) * per_rank)`. `phy2log[site, slot]` names the logical expert a slot holds; a logical
expert held by several slots has redundant copies (replicas), and a token routed to it goes to one of them.
The table is data: `uniform` builds the static one (logical expert e in slot e, then the redundant slots
filled round-robin), and any `phy2log` array (DeepSeek's EPLB output, `deepserve.core.balance.eplb`) can be
given instead, so that a later reassignment is a new table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MAIN_SITE = re.compile(r"^model\.layers\.(\d+)\.mlp(?:\.experts)?$")
_MTP_SITE = re.compile(r"^mtp\.(\d+)\.mlp(?:\.experts)?$")


class PlacementError(ValueError):
    """An expert placement that cannot work (sizes that do not divide, experts no slot holds, ...)."""


def site_index(name: str, num_hidden_layers: int) -> int | None:
    """The MoE site of a module or tensor prefix (`model.layers.3.mlp`, `model.layers.3.mlp.experts`,
    `mtp.0.mlp`): decoder layers first, then MTP blocks; None for anything else."""
    if m := _MAIN_SITE.match(name):
        return int(m.group(1))
    if m := _MTP_SITE.match(name):
        return num_hidden_layers + int(m.group(1))
    return None


@dataclass(frozen=True)
class ExpertPlacement:
    """`phy2log` [sites, physical] (int64): the logical expert each slot holds; `world_size` ranks hold
    `physical / world_size` consecutive slots each. Validated on construction."""

    phy2log: torch.Tensor
    num_logical: int
    world_size: int

    def __post_init__(self) -> None:
        p = self.phy2log
        if p.dim() != 2 or p.dtype != torch.int64:
            raise PlacementError(f"phy2log must be a 2-D int64 table [sites, physical], got {tuple(p.shape)} {p.dtype}")
        if self.world_size < 1:
            raise PlacementError(f"world_size must be positive, got {self.world_size}")
        if p.shape[1] % self.world_size:
            raise PlacementError(f"{p.shape[1]} physical experts do not divide over {self.world_size} ranks")
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= self.num_logical):
            raise PlacementError(f"phy2log names experts outside [0, {self.num_logical})")
        for site in range(p.shape[0]):
            missing = sorted(set(range(self.num_logical)) - set(p[site].tolist()))
            if missing:
                raise PlacementError(f"site {site}: logical expert(s) {missing[:8]} are held by no physical slot")
        # log2phy [sites, logical, max replicas] (-1 padded) and logcnt [sites, logical], as DeepSeek's EPLB
        count = torch.zeros(p.shape[0], self.num_logical, dtype=torch.int64)
        count.scatter_add_(1, p, torch.ones_like(p))
        table = torch.full((p.shape[0], self.num_logical, int(count.max()) if p.numel() else 1), -1, dtype=torch.int64)
        for site in range(p.shape[0]):
            seen = [0] * self.num_logical
            for slot, expert in enumerate(p[site].tolist()):
                table[site, expert, seen[expert]] = slot
                seen[expert] += 1
        object.__setattr__(self, "log2phy", table)
        object.__setattr__(self, "logcnt", count)

    @classmethod
    def uniform(cls, num_sites: int, num_logical: int, world_size: int, num_redundant: int = 0) -> ExpertPlacement:
        """Logical expert e in slot e; `num_redundant` extra slots hold experts 0, 1, ... again (so that
        `num_logical + num_redundant` divides over the ranks)."""
        if num_redundant < 0:
            raise PlacementError(f"num_redundant_experts must be >= 0, got {num_redundant}")
        total = num_logical + num_redundant
        if total % world_size:
            raise PlacementError(
                f"{num_logical} routed experts + {num_redundant} redundant = {total} physical experts do not divide "
                f"over {world_size} ranks (choose num_redundant_experts so that the sum is a multiple of it)")
        row = torch.cat([torch.arange(num_logical), torch.arange(num_redundant) % num_logical])
        return cls(row.repeat(num_sites, 1), num_logical, world_size)

    @classmethod
    def from_phy2log(cls, phy2log: Sequence, num_logical: int, world_size: int) -> ExpertPlacement:
        """From an array-like [sites, physical] (EPLB's `phy2log`)."""
        return cls(torch.as_tensor(phy2log, dtype=torch.int64).clone(), num_logical, world_size)

    @property
    def num_sites(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_local(self) -> int:
        """Slots per rank."""
        return self.num_physical // self.world_size

    def local_experts(self, site: int, rank: int) -> list[int]:
        """The logical experts rank `rank` holds at `site`, in slot order (a replica appears once per slot)."""
        return self.phy2log[site, rank * self.num_local : (rank + 1) * self.num_local].tolist()

    def physical(self, site: int, ids: torch.Tensor) -> torch.Tensor:
        """The slot each routed pair `ids` [T, k] goes to. A logical expert with replicas spreads its tokens over
        them by token row (row t takes replica t mod count): any replica computes the same bits, so this choice
        changes where work runs, never the output."""
        ids = ids.to(torch.int64)
        log2phy, logcnt = self._on(ids.device)
        count = logcnt[site][ids]
        row = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        return log2phy[site][ids, row % count]

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`log2phy` and `logcnt` on `device`, copied there once (not on every layer of every step)."""
        copies = self.__dict__.setdefault("_device_tables", {})
        if device not in copies:
            copies[device] = (self.log2phy.to(device), self.logcnt.to(device))
        return copies[device]
