"""The built-in expert-parallel transport: torch.distributed all-to-all (gloo on CPUs, NCCL on GPUs).

One exchange is one *round* of three collectives over the group:
1. an all-gather of every rank's header: [active, site, rows for each physical slot];
2. an all-to-all of the hidden rows, each rank's sorted by slot, so that a receiver knows from the headers
   which of its local slots (and which site) each row is for;
3. after the receiver's experts computed them, an all-to-all of the outputs back.
A rank that has finished its step (or has none) takes part with `active = 0` and no rows; a round in which no
rank is active ends everyone's step. Ranks may be at different sites in one round: rows carry their
sender's site. The counts travel to the host (`.tolist()`) each round, so a step through this transport cannot
be captured as a CUDA graph; the engine runs eagerly under it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepserve.distributed.placement import ExpertPlacement
from deepserve.distributed.transport import ExpertTransport, LocalExperts, TransportError


#: torch >= 2.10 names it all_gather_single; all_gather_into_tensor before
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AllToAllTransport(ExpertTransport):
    """`group`: the ranks' process group; `placement`: the slot table; `experts`: this rank's experts."""

    name = "all_to_all"

    def __init__(self, group, placement: ExpertPlacement, experts: LocalExperts) -> None:
        self.group, self.placement, self.experts = group, placement, experts
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if placement.world_size != self.world_size:
            raise TransportError(f"the expert placement is for {placement.world_size} ranks, the group has "
                                 f"{self.world_size}")
        self.num_rounds = 0

    def exchange(self, site: int, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        T, k = slots.shape
        flat = slots.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by destination rank, then by its local slot
        rows = x.index_select(0, order // k)
        counts = torch.bincount(flat, minlength=self.placement.num_physical)
        back = self._round(site, rows, counts, active=True)
        out = torch.empty_like(back)
        out[order] = back
        return out.view(T, k, x.shape[-1])

    def finish_step(self) -> None:
        e = self.experts
        empty = torch.empty(0, e.hidden_size, dtype=e.dtype, device=e.device)
        zeros = torch.zeros(self.placement.num_physical, dtype=torch.int64, device=e.device)
        while self._round(-1, empty, zeros, active=False) is not None:
            pass

    def _round(self, site: int, rows: torch.Tensor, counts: torch.Tensor, active: bool) -> torch.Tensor | None:
        W, L, P = self.world_size, self.placement.num_local, self.placement.num_physical
        header = torch.cat([torch.tensor([int(active), site], dtype=torch.int64, device=counts.device), counts])
        gathered = torch.empty(W * (2 + P), dtype=torch.int64, device=counts.device)
        try:
            _all_gather(gathered, header, group=self.group)
            table = gathered.view(W, 2 + P).cpu()
            self.num_rounds += 1
            if not bool(table[:, 0].any()):
                return None
            mine = table[:, 2 + self.rank * L : 2 + (self.rank + 1) * L]  # [W, L]: rows each rank sends me, by slot
            recv_split = mine.sum(1).tolist()
            send_split = counts.view(W, L).sum(1).tolist()
            received = rows.new_empty((sum(recv_split), rows.shape[-1]))
            dist.all_to_all_single(received, rows.contiguous(), recv_split, send_split, group=self.group)
            computed = torch.empty_like(received)
            start = 0
            for sender in range(W):
                n = recv_split[sender]
                if n:
                    local = torch.repeat_interleave(torch.arange(L, device=rows.device), mine[sender].to(rows.device))
                    computed[start : start + n] = self.experts.compute(int(table[sender, 1]),
                                                                       received[start : start + n], local)
                    start += n
            back = torch.empty_like(rows)
            dist.all_to_all_single(back, computed, send_split, recv_split, group=self.group)
        except RuntimeError as exc:  # gloo / NCCL: a peer closed its connection or a collective timed out
            raise TransportError(f"expert-parallel exchange failed on rank {self.rank}: {exc}") from exc
        return back
