"""The front's routing policy: which rank a new request goes to. Policies are plugins
(`deepserve_register_dp_routers`); the built-in `least_loaded` is the default, and DeepInfer's tiered prefill
router and two-dimensional decode balancer come later through the same seam."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankLoad:
    """What the front knows of one rank when it routes: `num_assigned` requests it sent there that have not
    finished (up to date), and the rank's last reported counters (one step old)."""

    rank: int
    num_assigned: int
    num_assigned_tokens: int  # prompt + max output tokens of those requests, as sent
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # pages used / total, in [0, 1]


class Router(ABC):
    """Called by the front on its engine thread, once per request, before it is sent."""

    @abstractmethod
    def choose(self, request_id: str, prompt_token_ids: Sequence[int], loads: Sequence[RankLoad]) -> int:
        """The rank (`loads[i].rank` of one entry) that serves this request."""
