"""EPLB while serving: per-site token counts per expert on the device, the windowed schedule of
`deepserve.core.balance.ExpertLoadBalancer`, and a reassignment that moves expert weights between ranks.

Every rank calls `after_step()` once per lockstep step (the rank loop does, after every step in which any rank
had work), so every rank sees the same all-reduced counts, computes the same new placement (EPLB is
deterministic) and moves weights in the same step. A move, per MoE site: each slot whose expert changes gets
it from this rank's old slots when it holds it, else from the lowest rank that did (one all-to-all of the
experts' flattened weights); then the site's weights and the transport switch to the new table together,
before the next step. Replicas compute the same bits, so a reassignment changes where tokens go, never an
output.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from deepserve.core.balance.expert_balancer import ExpertLoadBalancer
from deepserve.core.balance.placement import Placement

from .placement import ExpertPlacement

logger = logging.getLogger(__name__)


def as_balance_placement(placement: ExpertPlacement) -> Placement:
    """Our table as `deepserve.core.balance`'s `Placement` value."""
    rows = placement.phy2log.tolist()
    l2p = [[[s for s in row if s >= 0] for row in site] for site in placement.log2phy.tolist()]
    width = max(len(slots) for site in l2p for slots in site)
    return Placement(tuple(map(tuple, rows)),
                     tuple(tuple(tuple(slots + [-1] * (width - len(slots))) for slots in site) for site in l2p),
                     tuple(map(tuple, placement.logcnt.tolist())), placement.world_size)


class RankBalancer:
    """`sites`: the model's MoE layers by site (their `expert_parallel` handles hold the placement and count
    loads into `counts` [sites, experts] on the device); `transport`: the exchange, whose placement switches too."""

    def __init__(self, balancer: ExpertLoadBalancer, sites: list, transport, group, counts: torch.Tensor) -> None:
        self.balancer, self.sites, self.transport, self.group = balancer, sites, transport, group
        self.counts = counts
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_moves = 0
        self.num_slots_moved = 0  # this rank's slots whose expert a reassignment changed, all sites, all moves

    def after_step(self) -> None:
        rows = None
        if self.balancer.needs_counts:
            total = self.counts.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
            rows = total.tolist()
        self.counts.zero_()
        new = self.balancer.observe(rows, 1)
        if new is not None:
            self.move(ExpertPlacement.from_phy2log(new.phy2log, self.transport.placement.num_logical, self.world_size))

    def move(self, new: ExpertPlacement) -> None:
        """Reassign every site to `new`, moving the experts' weights between ranks (see the module docstring)."""
        old = self.transport.placement
        if new.phy2log.shape != old.phy2log.shape:
            raise ValueError(f"a reassignment keeps the slots: {tuple(old.phy2log.shape)} -> {tuple(new.phy2log.shape)}")
        moved = 0
        for site, moe in enumerate(self.sites):
            moved += self._move_site(site, moe, old, new)
        self.transport.placement = new
        for moe in self.sites:
            moe.expert_parallel.placement = new
        self.num_moves += 1
        self.num_slots_moved += moved
        logger.info("rank %d: EPLB reassignment %d at step %d: %d slots here changed", self.rank, self.num_moves,
                    self.balancer.step, moved)

    def _move_site(self, site: int, moe, old: ExpertPlacement, new: ExpertPlacement) -> int:
        W, L, me = self.world_size, old.num_local, self.rank
        old_rows, new_rows = old.phy2log[site].tolist(), new.phy2log[site].tolist()
        source = {}  # logical expert -> the lowest rank that holds it now
        for slot, expert in enumerate(old_rows):
            source.setdefault(expert, slot // L)
        w13, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
        flat = torch.cat([w13.reshape(L, -1), w2.reshape(L, -1)], dim=1)  # one row per local slot

        def plan(dest: int) -> list[tuple[int, int]]:
            """(dest's local slot, expert) it gets from a rank other than itself."""
            mine = old_rows[dest * L : (dest + 1) * L]
            return [(j, e) for j, e in enumerate(new_rows[dest * L : (dest + 1) * L])
                    if e not in mine]

        sends = [[e for _, e in plan(d) if source[e] == me] if d != me else [] for d in range(W)]
        receives = [[(j, e) for j, e in plan(me) if source[e] == s] if s != me else [] for s in range(W)]
        local_slot = {e: j for j, e in reversed(list(enumerate(old_rows[me * L : (me + 1) * L])))}
        send = torch.cat([flat[[local_slot[e] for e in row]] for row in sends if row] or [flat[:0]])
        recv = flat.new_empty((sum(map(len, receives)), flat.shape[1]))
        dist.all_to_all_single(recv, send.contiguous(), [len(r) for r in receives], [len(s) for s in sends],
                               group=self.group)
        arrived = {}
        offset = 0
        for row in receives:
            for j, _ in row:
                arrived[j] = recv[offset]
                offset += 1
        mine_new = new_rows[me * L : (me + 1) * L]
        rebuilt = torch.stack([arrived[j] if j in arrived else flat[local_slot[e]] for j, e in enumerate(mine_new)])
        n13 = w13[0].numel()
        with torch.no_grad():  # in place: the parameters' versions move on, so cached weight slices are remade
            w13.copy_(rebuilt[:, :n13].view_as(w13))
            w2.copy_(rebuilt[:, n13:].view_as(w2))
        return sum(a != b for a, b in zip(old_rows[me * L : (me + 1) * L], mine_new))
