"""The expert-parallel transport seam: how a routed pair's hidden row reaches the rank that holds its expert and
how the expert's output comes back.

Who calls: the MoE layer, once per forward at each MoE site (`exchange`), and the rank loop once per engine
step (`finish_step`). A transport is chosen at start-up from the `deepserve_register_expert_transports` plugins
(built-in: `all_to_all`, torch.distributed all-to-all on gloo or NCCL; DeepEP is the next one) and is handed:

- the process group (`torch.distributed.ProcessGroup`), not a global;
- the `ExpertPlacement` (which slot holds which logical expert);
- a `LocalExperts`: the experts this rank holds, which compute rows for any site.

Contract. Ranks step together but not layer by layer: one rank may be at site 3 of its forward while another
has finished its step, or is at site 0 of a second forward (a mixed step, an MTP draft). A transport must
therefore make progress for every rank whatever site each is at (the built-in tags each rank's rows with its
site), and `finish_step` takes part in the exchanges with nothing to send until every rank has finished its
step; a rank with no work calls only `finish_step` (its dummy step). A transport that needs every rank at the
same site (DeepEP's low-latency kernels) must make the rank loop run dummy forwards instead; say so in its
docs. `exchange` returns each pair's expert output *before* the routing weight, in the caller's pair order;
the MoE layer weighs and sums them in a fixed order, so that outputs are those of one process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch


class TransportError(RuntimeError):
    """The expert-parallel exchange failed: a peer died, timed out or broke the protocol."""


class LocalExperts(Protocol):
    """The routed experts one rank holds, for every MoE site."""

    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    def compute(self, site: int, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`W2(swiglu(W13 row))` for each row [R, D] with the expert in local slot `slots[i]` of `site`, in the
        rows' dtype ([R, D])."""


class ExpertTransport(ABC):
    """Dispatch and combine for expert parallelism (see the module docstring for the contract)."""

    name: str = ""

    @abstractmethod
    def exchange(self, site: int, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Send row `x[t]` to the rank holding physical slot `slots[t, j]` for each routed pair (t, j), have that
        rank's expert compute it, and return the outputs [T, k, D] (x's dtype) in (t, j) order. Every rank calls
        this the same way; T may be 0."""

    @abstractmethod
    def finish_step(self) -> None:
        """Serve the other ranks' exchanges, sending nothing, until every rank has called `finish_step`: the end
        of this rank's step (or all of a dummy step)."""

    def close(self) -> None:
        """Release what the transport holds (buffers, communicators)."""
