"""The synchronous engine core: one `step()` plans, launches, and finishes the previous step while this one runs.

With asynchronous scheduling (the default) the model runner executes on its own worker thread. Step N is
planned and submitted while step N-1 is still on the device; then the host applies N-1's samples (scheduler
update, detokenization, stop strings, outputs). So the device never waits for Python between steps, except for
the plan itself. The host-side gap between the end of one device step and the start of the next is recorded.
Plain Python: the runner is reached only through `ModelExecutor`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from deepserve.core.interfaces import ChunkInput, ModelExecutor, StepInput, StepOutput
from deepserve.core.outputs import CompletionOutput, RequestOutput
from deepserve.core.request import Request
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.scheduler.scheduler import Scheduler, SchedulerOutput
from deepserve.core.scheduler.cost_model import StepCostModel
from deepserve.core.stop_checker import StopStringTracker, min_tokens_blocked_ids
from deepserve.core.tracking import RequestTracker


@dataclass(slots=True)
class EngineStats:
    """Counters since start. `host_gaps` are seconds the runner sat idle between consecutive steps."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    host_gaps: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)


class EngineCore:
    """Requests in, `RequestOutput`s out, one `step()` at a time. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: ModelExecutor,
        *,
        page_size: int,
        enable_prefix_caching: bool = True,
        make_detokenizer: Callable[[Sequence[int], bool], object] | None = None,
        cost_model: StepCostModel | None = None,
        async_scheduling: bool = True,
        seed: int = 0,
    ) -> None:
        self.scheduler, self.executor, self.cost_model = scheduler, executor, cost_model
        self.page_size, self.enable_prefix_caching = page_size, enable_prefix_caching
        self.make_detokenizer = make_detokenizer
        self.async_scheduling, self.seed = async_scheduling, seed
        self._trackers: dict[str, RequestTracker] = {}
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepserve-runner")
        self._last_end: float | None = None
        self._counter = itertools.count()
        self.stats = EngineStats()

    # -- requests ------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None) -> None:
        if params.stop and self.make_detokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has no tokenizer.json")
        request = Request(request_id, prompt_token_ids, params, cache_salt)
        seed = params.seed if params.seed is not None else hash((self.seed, next(self._counter))) & (2**63 - 1)
        detok = self.make_detokenizer(request.prompt_token_ids, params.skip_special_tokens) \
            if self.make_detokenizer else None
        self.scheduler.add_request(request)  # validates; raises before anything is recorded
        self._trackers[request_id] = RequestTracker(request, prompt, seed, detok,
                                                    StopStringTracker(params.stop, params.include_stop_str_in_output))

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests at any time; their pages are freed now, their runner state at the next step."""
        return [self._trackers.pop(r.request_id).output() for r in self.scheduler.abort(list(request_ids))]

    def has_unfinished_requests(self) -> bool:
        """True until every request is done *and* the runner has dropped their state."""
        s = self.scheduler
        return s.has_unfinished_requests() or s.has_unreported_finishes or self._in_flight is not None

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan step N and launch it; finish step N-1 on the host while N runs. Returns updated requests."""
        plan = self.scheduler.schedule()
        launched = (plan, self._worker.submit(self._run, self._step_input(plan))) \
            if plan.chunks or plan.finished_request_ids or plan.preempted_request_ids else None
        outputs = self._finish(*self._in_flight) if self._in_flight else []
        self._in_flight = launched
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._finish(*self._in_flight)
            self._in_flight = None
        return outputs

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)

    def _run(self, step: StepInput) -> StepOutput:
        began = time.perf_counter()
        if self._last_end is not None and step.chunks:
            self.stats.host_gaps.append(began - self._last_end)
        out = self.executor.execute(step)
        self._last_end = time.perf_counter()
        return out

    def _step_input(self, plan: SchedulerOutput) -> StepInput:
        chunks = []
        for c in plan.chunks:
            request = self.scheduler.requests[c.request_id]
            tracker = self._trackers[c.request_id]
            params = request.sampling_params
            end = c.start + len(c.token_ids)
            blocked = ()
            if c.samples:
                before = request.num_output_tokens + request.num_pending_tokens - 1
                blocked = tuple(min_tokens_blocked_ids(params, self.scheduler.eos_token_ids, before))
            targets = ()
            if params.prompt_logprobs is not None and c.start < request.num_prompt_tokens - 1:
                targets = tuple(request.prompt_token_ids[c.start + 1 : min(end, request.num_prompt_tokens - 1) + 1])
            table = tuple(self.scheduler.kv.block_tables.get(c.request_id, ()))
            snaps = ()
            if self.enable_prefix_caching:
                P = self.page_size
                snaps = tuple((b, table[b // P - 1]) for b in range((c.start // P + 1) * P, end + 1, P))
            chunks.append(ChunkInput(c.request_id, c.start, c.token_ids, c.samples, table, params, tracker.seed,
                                     blocked, targets, snaps))
        return StepInput(tuple(chunks), plan.finished_request_ids + plan.preempted_request_ids)

    def _finish(self, plan: SchedulerOutput, future: Future) -> list[RequestOutput]:
        out: StepOutput = future.result()
        self.stats.num_steps += 1
        self.stats.step_seconds.append(out.seconds)
        if self.cost_model is not None and plan.chunks:
            self.cost_model.observe([(len(c.token_ids), c.start) for c in plan.chunks], max(out.seconds, 1e-9))
        self.scheduler.update_from_output(plan, out.sampled)
        touched: dict[str, RequestTracker] = {}
        for c in plan.chunks:
            tracker = self._trackers.get(c.request_id)
            if tracker is None:
                continue  # aborted or finished while this step ran
            if c.request_id in out.prompt_logprobs:
                tracker.add_prompt_logprobs(c.start, out.prompt_logprobs[c.request_id])
            if c.samples and tracker.absorb(out.logprobs.get(c.request_id), out.sampled_logprobs.get(c.request_id)):
                self.stats.num_generation_tokens += 1
            if c.start + len(c.token_ids) >= tracker.request.num_prompt_tokens > c.start:
                self.stats.num_prompt_tokens += tracker.request.num_prompt_tokens - tracker.request.num_cached_tokens
            touched[c.request_id] = tracker
        for request_id, tracker in touched.items():
            if tracker.stop_match is not None and not tracker.request.is_finished:
                self.scheduler.finish_requests([request_id], "stop", tracker.stop_match.stop)
            if tracker.request.is_finished:
                del self._trackers[request_id]
        return [t.output() for t in touched.values()]
