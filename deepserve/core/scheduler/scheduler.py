"""`Scheduler`: continuous batching with chunked prefill, prefix reuse and preemption by recompute.

The contract is two calls per engine step:

1. `schedule()` decides what every request computes this step and returns a `SchedulerOutput` (a value object:
   the model runner never sees a live `Request`); the scheduled tokens count as computed from then on;
2. `update_from_output(sched_out, sampled)` takes the token sampled for each chunk that ends at its request's
   last token, appends it, applies the stop rules, and returns the requests that finished.

Asynchronous scheduling: `schedule()` for step N may run before `update_from_output()` of step N-1, while the
device still computes N-1. A request sampling in N-1 then has one *pending* token whose id is not known yet;
step N computes it anyway, as a placeholder id (`PLACEHOLDER`) the model runner fills from N-1's sampled
tokens on the device. If N-1's token finishes the request, its work in step N is discarded.

Speculative decoding: a request's drafts (`Request.spec_token_ids`) are simply more tokens to catch up on.
A decoding request with k drafts computes 1 + k tokens (its last token and the drafts); `update_from_output`
then learns how many drafts the target kept, appends them and the token after them, and moves
`num_computed_tokens` back past the rejected ones (their pages stay reserved for the next drafts).
With asynchronous scheduling, a request whose previous step is still running verifies that step's drafts as
`DRAFT_PLACEHOLDER`s after its pending token; if that step verified drafts too, the new chunk is *relative*
(it starts wherever the kept drafts leave the sequence, which only the runner knows), and the request's
`num_computed_tokens` and `num_pending_tokens` are upper bounds (every draft kept) until the update corrects
them. Pages are reserved for the upper bound.

`add_request` and `abort` may be called at any time between or around those two calls. Plain Python, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from deepserve.core.interfaces import DRAFT_PLACEHOLDER, PLACEHOLDER
from deepserve.core.kv.manager import KVCacheManager
from deepserve.core.outputs import FinishReason
from deepserve.core.request import Request, RequestStatus
from deepserve.core.scheduler.cost_model import Chunk, StepCostModel
from deepserve.core.stop_checker import check_stop




class ScheduledChunk(NamedTuple):
    """Tokens `[start, start + len(token_ids))` of one request, to compute this step (a named tuple: one per
    request per step, built faster than a frozen dataclass; `_add_chunk` makes them, never empty).

    `samples` is True when the chunk ends at the request's last token, so the runner samples a token. A token id
    `PLACEHOLDER` stands for the token the previous step samples for this request. The last `num_draft_tokens`
    token ids are speculative drafts to verify; `forced_drafts`: they are tokens the request's grammar forces,
    not the drafter's (verified by exact match with the target's own sample: no draft distribution to correct).
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    samples: bool
    num_draft_tokens: int = 0
    relative: bool = False
    forced_drafts: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan. `preempted_request_ids` lost their KV this step (they will recompute it);
    `finished_request_ids` finished (stopped, hit a length limit or were aborted) since the previous step,
    so the runner can drop any per-request state it keeps."""

    chunks: tuple[ScheduledChunk, ...]
    num_scheduled_tokens: int
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_scheduled_tokens != sum(len(c.token_ids) for c in self.chunks):
            raise ValueError("num_scheduled_tokens must equal the total length of the chunks")


@dataclass(slots=True)
class _StepPlan:
    """What `schedule()` has decided so far this step."""

    budget: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    cost_chunks: list[Chunk] = field(default_factory=list)  # (n, p) of each chunk, for the cost model
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    """FIFO continuous batching over one `KVCacheManager`, prefill chunks sized by an optional `StepCostModel`.

    Running requests are served first, oldest first; then waiting ones are admitted in arrival order while
    fewer than `max_num_seqs` run and the step's `max_num_batched_tokens` budget lasts. When pages run out for
    a running request, the newest running request is preempted: its pages are freed and it goes back to the
    front of the waiting queue to recompute (prefix hits make that cheap).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        cost_model: StepCostModel | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Collection[int] = (),
        verify_planner: Callable[..., list[int]] | None = None,
    ) -> None:
        """`verify_planner` (DSpark): `verify_planner(confidences, other_tokens=, other_outputs=)` -> given the
        draft confidences of the running requests that have drafts, and the step's other work (tokens the other
        running requests catch up on, tokens they sample), how many of each request's drafts to verify this
        step; without one every draft is verified."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.kv = kv
        self.cost_model = cost_model
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.verify_planner = verify_planner
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first to be preempted
        self._finished_ids: list[str] = []  # finished since the last schedule()
        self._num_arrivals = 0
        self.num_preemptions = 0
        self._loading_kv: set[str] = set()  # waiting requests whose prefix blocks are loading
        self._resumes: dict[str, tuple[int, int]] = {}  # request -> (base tokens, tokens) an SWA slot restores

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_unreported_finishes(self) -> bool:
        """Requests finished since the last `schedule()`, whose runner state the next step output frees."""
        return bool(self._finished_ids)

    def add_request(self, request: Request, awaiting_grammar: bool = False, loading_kv: bool = False) -> None:
        """Queue a new request. Its prompt must leave room for at least one output token in `max_model_len`.
        `awaiting_grammar`: its grammar is still compiling; it prefills but does not sample until `grammar_ready`.
        `loading_kv`: its prefix blocks are loading from a cache tier below the GPU; it waits (others pass it)
        until `kv_loaded`."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} has already been scheduled")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens; "
                             f"max_model_len={self.max_model_len} leaves no room for output")
        request.arrival_order = self._num_arrivals
        request.awaiting_grammar = awaiting_grammar
        self._num_arrivals += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if loading_kv:
            self._loading_kv.add(request.request_id)

    def kv_loaded(self, request_id: str) -> None:
        """The request's prefix blocks are in GPU pages now (or were not found): it may be admitted."""
        self._loading_kv.discard(request_id)

    def resume_from_slot(self, request_id: str, base_tokens: int, num_tokens: int) -> None:
        """The request continues a sequence whose state at `num_tokens` an SWA host slot holds: if its prefix hit
        at first admission is exactly `base_tokens` (the pages before the slot's tail), it starts at `num_tokens`
        (the engine restores the slot into its first chunk's sequence); else the slot is not used."""
        if not 0 <= base_tokens < num_tokens < self.requests[request_id].num_prompt_tokens:
            raise ValueError(f"cannot resume request {request_id!r} at {num_tokens} tokens after {base_tokens}")
        self._resumes[request_id] = (base_tokens, num_tokens)

    def grammar_ready(self, request_id: str) -> None:
        """The request's grammar has compiled: it may sample from its next step on."""
        self.requests[request_id].awaiting_grammar = False

    def drafts_in_flight(self, request_id: str, num_drafts: int) -> None:
        """The step being launched drafts `num_drafts` tokens for the request (what the next plan, made before
        that step's outputs come back, holds as placeholders)."""
        self.requests[request_id].num_drafts_in_flight = num_drafts

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish these requests with reason "abort" and free their pages; unknown or finished ids are ignored.

        Safe at any time, also between `schedule()` and `update_from_output()`: the chunks of an aborted request
        in that step's output are then skipped. Returns the requests aborted.
        """
        return self.finish_requests(request_ids, "abort")

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Finish requests from outside the step (abort, or a stop string found in the detokenized text)."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish(reason, stop_reason)
            self._retire(request)
            finished.append(request)
        return finished

    def schedule(self) -> SchedulerOutput:
        # Token catch-up: every request computes `num_tokens - num_computed_tokens` tokens this step, capped by
        # the chunk size and the step's token budget; a prefix hit just advances num_computed_tokens when the
        # request is admitted, and a decode is simply the case where the gap is 1 token.
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        for request in self.running:
            request.next_drafts = self._next_drafts(request)
        if self.verify_planner is not None:
            self._plan_verify_lengths()
        self._schedule_running(plan)
        # Right after a preemption the pages are too scarce to admit anyone: doing so would only thrash.
        if not plan.preempted:
            self._admit_waiting(plan)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            chunks=tuple(plan.chunks),
            num_scheduled_tokens=self.max_num_batched_tokens - plan.budget,
            preempted_request_ids=tuple(plan.preempted),
            finished_request_ids=finished,
        )

    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[str, int],
                           num_accepted: dict[str, int] | None = None,
                           drafts: dict[str, list[int]] | None = None,
                           confidences: dict[str, list[float]] | None = None) -> list[Request]:
        """Apply a step's results: append the token sampled for each chunk with `samples=True` (after the drafts
        the target kept, `num_accepted`), cache the request's newly full blocks and check the stop rules; keep
        the new `drafts` (and their `confidences`) for the next step. Returns the requests that finished; their
        pages are free again. Requests finished or aborted since `schedule()` are skipped."""
        finished = []
        requests, num_accepted, drafts, confidences = self.requests, num_accepted or {}, drafts or {}, confidences or {}
        running_status = RequestStatus.RUNNING
        for chunk in sched_out.chunks:
            request = requests.get(chunk.request_id)
            if request is None:
                continue
            new_tokens = [sampled[chunk.request_id]] if chunk.samples else []
            k = chunk.num_draft_tokens
            running = request.status is running_status
            if k:
                kept = num_accepted.get(chunk.request_id, 0)
                if running:
                    request.num_computed_tokens -= k - kept  # rejected: computed again later
                request.num_inflight_verifies -= 1
                request.num_verified_tokens += k
                request.num_accepted_tokens += kept
                verified = chunk.token_ids[len(chunk.token_ids) - k:]
                if DRAFT_PLACEHOLDER in verified:  # planned before they were known: the previous update's drafts
                    verified = request.spec_token_ids[:k]
                new_tokens = list(verified[:kept]) + new_tokens
            if chunk.samples:
                made = drafts.get(chunk.request_id, ()) if drafts else ()
                # not running (preempted): the runner drops its state and drafts
                request.spec_token_ids = list(made) if running else []
                request.spec_confidences = list(confidences.get(chunk.request_id, ())) if running else []
                request.spec_forced = False
                request.num_draft_tokens += len(made)
            if running:  # before the stop check: a finishing request's prompt counts
                self.kv.cache_full_blocks(request.request_id, request.all_token_ids,
                                          min(request.num_computed_tokens, request.num_tokens), request.cache_salt,
                                          request.sampling_params.cache_ttl)
            if not chunk.samples:
                if request.sampling_params.max_tokens == 0 and running \
                        and chunk.start + len(chunk.token_ids) >= request.num_tokens:  # its prompt's last chunk
                    request.finish("length")
                    self.running.remove(request)
                    self._retire(request)
                    finished.append(request)
                continue
            request.num_pending_tokens -= 1 + k
            if len(new_tokens) == 1:  # a decode step's one token (no generator: this runs per request per step)
                ends = self._append_token(request, new_tokens[0])
            else:  # kept drafts, then the sample: stops at the first that ends the request
                ends = any(self._append_token(request, token) for token in new_tokens)
            if ends:
                if request in self.running:
                    self.running.remove(request)
                else:  # preempted after this step was planned: it waits for recompute
                    self.waiting.remove(request)
                self._retire(request)
                finished.append(request)
        return finished

    def force_drafts(self, request_id: str, token_ids: list[int]) -> None:
        """Make the tokens a request's grammar forces next its drafts, in place of the drafter's (engine, after the
        update, when no step for the request is in flight: its next chunk is planned from these ids). They count
        as drafts made instead of the ones they replace; their confidence is 1."""
        request = self.requests[request_id]
        request.num_draft_tokens += len(token_ids) - len(request.spec_token_ids)
        request.spec_token_ids, request.spec_confidences = list(token_ids), [1.0] * len(token_ids)
        request.spec_forced = True

    @staticmethod
    def _next_drafts(request: Request) -> list[int]:
        """The drafts a request's next chunk verifies: those of the last update, or, while a step that makes
        new ones is still running (asynchronous scheduling), placeholders for those."""
        if request.num_pending_tokens:
            return [DRAFT_PLACEHOLDER] * request.num_drafts_in_flight
        return request.spec_token_ids if not request.num_inflight_verifies else []

    def _plan_verify_lengths(self) -> None:
        drafting = [r for r in self.running if r.next_drafts]
        if not drafting:
            return
        # with a step in flight, the confidences are those of the drafts before (one step old)
        confidences = [(r.spec_confidences or [1.0] * len(r.next_drafts))[: len(r.next_drafts)] for r in drafting]
        confidences = [c + [c[-1] if c else 1.0] * (len(r.next_drafts) - len(c)) for c, r in zip(confidences, drafting)]
        other_tokens = other_outputs = 0
        for r in self.running:  # what else the step will compute, as far as it is known before admission
            if not r.next_drafts:
                catch_up = r.num_tokens_with_pending - r.num_computed_tokens
                other_tokens += max(catch_up, 0)
                other_outputs += 0 < catch_up <= self.max_num_batched_tokens
        other_tokens = min(other_tokens, self.max_num_batched_tokens)
        for request, length in zip(drafting, self.verify_planner(confidences, other_tokens=other_tokens,
                                                                 other_outputs=other_outputs)):
            del request.next_drafts[length:]

    def _cap_drafts(self, request: Request, budget: int) -> None:
        """Verify no draft past the request's last possible token, nor more than the step's budget holds."""
        spec = request.next_drafts
        if not spec:
            return
        room = self.max_model_len - request.num_tokens_with_pending - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - request.num_pending_tokens - 1)
        room = min(room, budget - (request.num_tokens_with_pending - request.num_computed_tokens))
        del spec[max(room, 0):]

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            if self._finishes_with_pending(request):
                index += 1  # its in-flight token is its last: computing past it would be wasted
                continue
            self._cap_drafts(request, plan.budget)
            num_new = self._chunk_size(request, plan)
            if num_new == 0:  # waiting for its grammar, prompt computed up to the sampling position
                index += 1
                continue
            while self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new) is None:
                victim = self.running[-1]  # always at or after `index`: requests already planned are never victims
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                self._add_chunk(request, num_new, plan)
                index += 1

    def _admit_waiting(self, plan: _StepPlan) -> None:
        held: list[Request] = []  # awaiting their grammar with nothing left to prefill: the others pass them
        while self.waiting and len(self.running) < self.max_num_seqs and plan.budget > 0:
            request = self.waiting[0]
            if request.num_inflight_verifies or request.request_id in self._loading_kv:
                held.append(self.waiting.popleft())  # its length is known after the update; its KV is loading
                continue
            # a request that wants its prompt's logprobs computes every prompt token (a hit would skip them)
            wants_prompt = request.sampling_params.prompt_logprobs is not None and not request.num_output_tokens
            _, num_cached = self.kv.get_computed_blocks(request.request_id, request.all_token_ids,
                                                        request.cache_salt, use_hits=not wants_prompt,
                                                        ttl_class=request.sampling_params.cache_ttl)
            resume = self._resumes.get(request.request_id)
            if resume is not None and request.status is RequestStatus.WAITING and not wants_prompt \
                    and num_cached == resume[0]:
                num_cached = resume[1]  # the pages' tokens, then the slot's tail
            request.num_computed_tokens = num_cached
            num_new = self._chunk_size(request, plan)
            if num_new == 0 or self.kv.allocate_slots(request.request_id, num_cached + num_new) is None:
                self.kv.free(request.request_id)  # give back the prefix hit
                request.num_computed_tokens = 0
                if num_new:
                    break  # FIFO: nobody overtakes a request that does not fit
                held.append(self.waiting.popleft())
                continue
            if request.status is RequestStatus.WAITING:  # first admission, not a resume after preemption
                request.num_cached_tokens = num_cached
            self._resumes.pop(request.request_id, None)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_chunk(request, num_new, plan)
        self.waiting.extendleft(reversed(held))

    def _finishes_with_pending(self, request: Request) -> bool:
        pending = request.num_pending_tokens
        if not pending:
            return False
        max_tokens = request.sampling_params.max_tokens
        outputs = len(request.output_token_ids) + pending
        return (max_tokens is not None and outputs >= max_tokens) \
            or len(request.prompt_token_ids) + outputs >= self.max_model_len

    def _chunk_size(self, request: Request, plan: _StepPlan) -> int:
        remaining = request.num_tokens_with_pending + len(request.next_drafts) - request.num_computed_tokens
        if request.awaiting_grammar:  # prefill, but stop short of the sampling position until the grammar is ready
            remaining -= 1
        num_new = min(remaining, plan.budget)
        if num_new <= 0:
            return 0
        if self.cost_model is not None and num_new > 1 and not request.next_drafts:
            num_new = self.cost_model.largest_chunk(request.num_computed_tokens, remaining, cap=num_new,
                                                    other_chunks=plan.cost_chunks)
        return num_new

    def _add_chunk(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        spec = request.next_drafts
        num_tokens = request.num_tokens
        with_pending = num_tokens + request.num_pending_tokens
        # (a decode with its token in flight knows none of its tokens: skip the empty slice)
        known = request.all_token_ids[start:end] if start < num_tokens else ()
        num_placeholders = min(num_new - len(known), with_pending - start - len(known))
        tokens = tuple(known) + (PLACEHOLDER,) * num_placeholders
        num_drafts = num_new - len(tokens)  # _cap_drafts made the budget hold all of them
        if spec:
            del spec[num_drafts:]
            tokens += tuple(spec)
        # max_tokens=0: the prompt alone (its logprobs); the update finishes the request once it is computed
        samples = end == with_pending + len(spec) and request.sampling_params.max_tokens != 0
        relative = request.num_inflight_verifies > 0  # where it starts depends on drafts not yet judged
        forced = num_drafts > 0 and request.spec_forced and DRAFT_PLACEHOLDER not in spec
        plan.chunks.append(ScheduledChunk(request.request_id, start, tokens, samples, num_drafts, relative,
                                          forced))
        plan.cost_chunks.append((num_new, start))
        plan.budget -= num_new
        request.num_computed_tokens = end  # counted as computed from now on: the device will have done it
        request.next_drafts = []
        if samples:
            request.num_pending_tokens += 1 + num_drafts  # an upper bound: every draft kept
        if num_drafts:
            request.num_inflight_verifies += 1

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        if not request.num_inflight_verifies:  # made from state the runner now drops; else a step in flight
            # verifies them as placeholders and its update reads the kept ones from here (and then drops them)
            request.spec_token_ids, request.spec_confidences = [], []
        request.spec_forced = False
        request.next_drafts = []
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        plan.preempted.append(request.request_id)
        self.num_preemptions += 1

    def _append_token(self, request: Request, token_id: int) -> bool:
        """Append a sampled token; True when it finishes the request."""
        request.output_token_ids.append(token_id)
        reason, stop_reason = check_stop(token_id, request.num_output_tokens, request.num_tokens,
                                         request.sampling_params, self.eos_token_ids, self.max_model_len)
        if reason is None:
            return False
        request.finish(reason, stop_reason)
        return True

    def _retire(self, request: Request) -> None:
        self._loading_kv.discard(request.request_id)
        self._resumes.pop(request.request_id, None)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
