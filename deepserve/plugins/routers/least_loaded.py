"""The default routing policy: the rank with the fewest unfinished requests the front sent it, then the fewest
of their tokens, then the lowest rank (so that equal loads route the same way every run)."""

from __future__ import annotations

from collections.abc import Sequence

from deepserve.distributed.router import RankLoad, Router


class LeastLoaded(Router):
    def choose(self, request_id: str, prompt_token_ids: Sequence[int], loads: Sequence[RankLoad]) -> int:
        return min(loads, key=lambda load: (load.num_assigned, load.num_assigned_tokens, load.rank)).rank
