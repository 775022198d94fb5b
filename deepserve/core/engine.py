"""The synchronous engine core: one `step()` plans, launches, and finishes the previous step while this one runs.

With asynchronous scheduling (the default) the model runner executes on its own worker thread. Step N is
planned and submitted while step N-1 is still on the device; then the host applies N-1's samples (scheduler
update, detokenization, stop strings, outputs). So the device never waits for Python between steps, except for
the plan itself. The runner may return a step before its samples reach the host (`StepOutput.resolve`, called
here before the samples are applied), so its worker launches step N while N-1 still computes. The gap between
the runner's return from one step and its start of the next is recorded.

Structured output rides the same pipeline: once step N-1's samples are applied, each constrained request's
matcher consumes its new token and fills its row of step N's token bitmask, which the runner (already running
N's forward) waits for just before sampling. Grammars compile on the `GrammarCompiler`'s threads; a request
whose grammar is not ready prefills but does not sample (the scheduler stops it short).

Speculative decoding (`num_speculative_tokens` > 0): the runner drafts after every step and the next step
verifies the drafts. With asynchronous scheduling, step N + 1 is planned before step N's kept count and drafts
are known: a request verifying in N verifies N's drafts in N + 1 as placeholders the runner fills, from
wherever N's kept drafts leave it (a *relative* chunk; see the scheduler), and DSpark plans N + 1's verify
lengths from the confidences of the drafts before (one step old). Requests with `logprobs`,
or still under `min_tokens`, do not draft (they decode one token per step as before). Constrained requests do:
their matcher checks the drafts and fills one mask row per verified position (`fill_draft_masks`), so the
target distribution the drafts are verified against is the grammar-masked one. Where the grammar forces the next
tokens (`forced_tokens()`: a JSON schema's keys and punctuation), those are the request's drafts instead of the
drafter's, verified by exact match with the target's own sample; only when no step for the request is in flight
(synchronous scheduling), since a step already planned verifies the drafter's drafts as placeholders. With a
verify planner (DSpark) the scheduler trims every request's drafts to the planned length before each step,
and the planner's step-time curve learns from every step's size and duration.
Plain Python: the runner is reached only through `ModelExecutor`.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

from deepserve.core.kv.prefix_hash import block_hashes
from deepserve.core.kv.swa_slots import Resume, SlotSnapshot, SWASlots
from deepserve.core.kv.tiers import KVTiers, TierStats
from deepserve.core.interfaces import DRAFT_PLACEHOLDER, ChunkInput, ModelExecutor, StepInput, StepMasks, StepOutput
from deepserve.core.outputs import RequestOutput
from deepserve.core.request import Request, RequestStatus
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.scheduler.scheduler import Scheduler, SchedulerOutput
from deepserve.core.scheduler.cost_model import StepCostModel
from deepserve.core.stop_checker import StopStringTracker, min_tokens_blocked_ids
from deepserve.core.grammar_compiler import GrammarCompiler, timeout_message
from deepserve.core.structured import GrammarBackend, GrammarMatcher, GrammarTimeout
from deepserve.core.tracking import GRAMMAR_ERROR_PREFIX, GrammarState, RequestTracker

#: how long an idle `step()` waits for a grammar compile (or a prefix load) when nothing else can run
_GRAMMAR_POLL_SECONDS = 0.05
logger = logging.getLogger(__name__)


class PageIO(Protocol):
    """Copies KV pages to and from host memory for the cache tiers (the runner's side: `build.py` wires
    `deepserve.model.kv_cache.read_pages` / `write_pages`). Called on the runner's thread only."""

    def read(self, pages: Sequence[int]) -> list: ...

    def write(self, pages: Sequence[int], blocks: Sequence) -> None: ...


class SlotIO(Protocol):
    """Moves a sequence's window state past its last full page to and from an SWA host slot (the runner's side:
    `ModelRunner.save_sequence` / `restore_sequence`). Called on the runner's thread only."""

    def save_sequence(self, request_id: str) -> tuple[int, bytes] | None: ...

    def restore_sequence(self, request_id: str, table: list[int], num_tokens: int, payload: bytes) -> None: ...


@dataclass(slots=True)
class EngineStats:
    """Counters since start. `host_gaps` are seconds the runner's thread sat idle between consecutive steps (the
    device may still be computing the earlier one: see `StepOutput.resolve`). For steps with constrained
    requests: `mask_fill_seconds` (host time filling the bitmask) and `mask_wait_seconds` (time the runner waited
    for it after its forward: the structured-output overhead left after the overlap)."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    host_gaps: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    mask_fill_seconds: list[float] = field(default_factory=list)
    mask_wait_seconds: list[float] = field(default_factory=list)
    spec: SpecDecodeStats = field(default_factory=lambda: SpecDecodeStats())


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding since start. A *sequence-step* is one decoding request in one step (it verifies 0..k
    drafts and gains 1 + accepted tokens). `accepted_by_position[j]` / `verified_by_position[j]` count draft
    j + 1 over all sequence-steps: their ratio is the acceptance rate at that draft position."""

    num_seq_steps: int = 0
    num_draft_tokens: int = 0
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0
    verified_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    num_forced_draft_tokens: int = 0  # drafts that were tokens a grammar forced (in num_draft_tokens too)

    def record(self, num_verified: int, num_accepted: int) -> None:
        self.num_seq_steps += 1
        self.num_verified_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        grow = num_verified - len(self.verified_by_position)
        if grow > 0:
            self.verified_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(num_verified):
            self.verified_by_position[j] += 1
            self.accepted_by_position[j] += j < num_accepted


@dataclass(frozen=True, slots=True)
class SWAReplayCounts:
    """SWA replays run so far (`mode`: `exact` or `bounded`, the `swa_replay` option) and the tokens they
    recomputed."""

    mode: str
    num_replays: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's numbers at one moment, as a value: what other threads read (the server's metrics), instead of
    the engine's live objects. `EngineCore.snapshot()` makes one on the engine's thread."""

    num_requests_running: int
    num_requests_waiting: int
    num_kv_pages_used: int
    num_kv_pages_total: int
    num_prefix_queries: int
    num_prefix_hits: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_speculative_tokens: int
    spec: SpecDecodeStats | None  # a copy; None without speculative decoding
    kv_tiers: dict[str, TierStats] | None = None  # copies, by tier (`host`, `store`); None without tiers
    swa_slots: SlotSnapshot | None = None  # None without SWA host slots
    swa_replay: SWAReplayCounts | None = None  # None without SWA replay (a store that keeps window snapshots)


@dataclass(slots=True)
class _PendingMasks:
    """A launched step's grammar masks, still to fill: row group i is for request `request_ids[i]`, and checks
    its drafts `drafts[i]` (one row, or 1 + k rows with k drafts)."""

    request_ids: tuple[str, ...]
    masks: StepMasks
    drafts: tuple[tuple[int, ...], ...] = ()


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
        grammars: GrammarCompiler | None = None,
        num_speculative_tokens: int = 0,
        verify_planner=None,
        kv_tiers: KVTiers | None = None,
        page_io: PageIO | None = None,
        swa_slots: SWASlots | None = None,
        slot_io: SlotIO | None = None,
        replay_snapshot: Callable[[list[int], int, Sequence[int]], int] | None = None,
        swa_replay_mode: str = "exact",
        freeze_gc: bool = False,
    ) -> None:
        """`num_speculative_tokens`: drafts per step when the runner has a proposer (0: no speculation);
        `verify_planner`: DSpark's planner (`plan(confidences, other_tokens=, other_outputs=) -> lengths`,
        `observe(num_tokens, seconds)`); the scheduler is built with its `plan`, this engine feeds it `observe`.
        `freeze_gc`: every object alive now (the modules, the model's Python objects, tokenizer tables, the
        graphs' bookkeeping: ~190k on the CPU demo) leaves the garbage collector's generations (`gc.freeze`, as
        vLLM freezes its heap once its engine is up), until `shutdown` gives them back (`gc.unfreeze`). A full
        collection then walks only what requests allocate: on the CPU demo at 256 sequences a full collection of
        the unfrozen heap took 48 ms, frozen 2.7 ms, a stall that lands on one step
        (bench/investigations/gc_pauses.py)."""
        self.scheduler, self.executor, self.cost_model = scheduler, executor, cost_model
        self.num_speculative_tokens, self.verify_planner = num_speculative_tokens, verify_planner
        if verify_planner is not None and scheduler.verify_planner != verify_planner.plan:
            raise ValueError("the scheduler must be built with verify_planner=planner.plan of the engine's planner "
                             "(the engine feeds the planner step times; the scheduler asks it for lengths)")
        self.grammars = grammars  # None: this engine refuses structured-output requests
        self.page_size, self.enable_prefix_caching = page_size, enable_prefix_caching
        self.make_detokenizer = make_detokenizer
        self.async_scheduling, self.seed = async_scheduling, seed
        self._trackers: dict[str, RequestTracker] = {}
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepserve-runner")
        self._last_end: float | None = None
        self._counter = itertools.count()
        self._compiling: dict[str, RequestTracker] = {}  # requests whose grammar is not ready yet
        self._cut_short: set[str] = set()  # this step: requests whose kept drafts ran past where they stop
        self.stats = EngineStats()
        # the cache tiers below the GPU pages: prefix blocks load before admission, computed ones are offloaded
        if (kv_tiers is None) != (page_io is None):
            raise ValueError("kv_tiers and page_io come together (the tiers' blocks are copied through page_io)")
        self.kv_tiers, self.page_io = kv_tiers, page_io
        self._copies_in: list[tuple[list[int], list]] = []  # (pages, blocks) the next step writes first
        if kv_tiers is not None:
            scheduler.kv.record_new_blocks = True
            if kv_tiers.ttl_class is not None:  # requests without a `cache_ttl` of their own write this class
                scheduler.kv.default_ttl_class = kv_tiers.ttl_class
        # SWA host slots: a finished sequence's tail state is saved, a request continuing it restores it
        if (swa_slots is None) != (slot_io is None):
            raise ValueError("swa_slots and slot_io come together (the slots' states are moved through slot_io)")
        self.swa_slots, self.slot_io = swa_slots, slot_io
        self._sessions: dict[str, str | None] = {}  # request -> its session_id, for its slot
        self._resumes: dict[str, Resume] = {}  # request -> the slot its first chunk restores
        self._continued: dict[str, str] = {}  # request -> the key of the slot it was restored from
        # saves submitted to the runner's thread and maybe not done: a new request's slot lookup waits for them
        self._slot_saves: list[Future] = []
        # SWA replay: `replay_snapshot(table, boundary, token_ids)` rebuilds a hit's last page snapshot (runner side)
        self.replay_snapshot, self.swa_replay_mode = replay_snapshot, swa_replay_mode
        self.num_replayed_tokens = self.num_replays = 0  # written on the runner's thread, read by `snapshot`
        self._froze_gc = freeze_gc
        if freeze_gc:
            gc.collect()  # (the garbage of building, not frozen with the rest)
            gc.freeze()

    # -- requests ------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None, final_only: bool = False,
                    views: bool = False, session_id: str | None = None) -> None:
        """`final_only`: `step()` returns this request's output once, when it finishes, instead of a snapshot
        every step (a snapshot copies the output so far: at 256 requests 2,000 tokens in, most of a step's host
        time; bench/engine_host.py). For callers that read only the end, like `LLM.generate`. `views`: each
        snapshot's token ids and logprobs are read-only `outputs.Prefix` views of the request's lists, not
        copies; for streaming callers that index, slice and take lengths (the server). `session_id` (or the
        OpenAI `conversation`): the session whose SWA host slot this request continues and then replaces
        (docs/cache.md); without one, the slot of the longest finished sequence the prompt begins with."""
        if params.stop and self.make_detokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has no tokenizer.json")
        spec = params.structured_outputs
        if spec is not None and self.grammars is None:
            raise ValueError("structured outputs need a grammar backend, and this engine has none "
                             "(the model has no tokenizer.json, or no grammar backend plugin is installed)")
        if params.uses_logits_processors:
            if self.num_speculative_tokens:
                raise ValueError("penalties, logit_bias and bad_words are not supported with speculative decoding")
            if params.bad_words and params.bad_words_token_ids is None:
                raise ValueError("bad_words need their token ids: call params.update_from_tokenizer(encode) first")
        request = Request(request_id, prompt_token_ids, params, cache_salt)
        seed = params.seed if params.seed is not None else hash((self.seed, next(self._counter))) & (2**63 - 1)
        detok = self.make_detokenizer(request.prompt_token_ids, params.skip_special_tokens) \
            if self.make_detokenizer else None
        future = self.grammars.submit(spec) if spec is not None else None  # raises for an unknown backend
        loading = self._start_kv_load(request)
        try:
            self.scheduler.add_request(request, awaiting_grammar=spec is not None, loading_kv=loading)  # validates
        except BaseException:
            if loading:
                self.kv_tiers.cancel(request_id)
            raise
        if self.swa_slots is not None:
            self._find_slot(request, session_id)
        tracker = self._trackers[request_id] = RequestTracker(
            request, prompt, seed, detok, StopStringTracker(params.stop, params.include_stop_str_in_output),
            final_only, views)
        if spec is not None:
            tracker.grammar = GrammarState(spec, future, time.monotonic() + self.grammars.timeout)
            self._compiling[request_id] = tracker

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests at any time; their pages are freed now, their runner state at the next step."""
        aborted = self.scheduler.abort(list(request_ids))
        for request in aborted:
            self._compiling.pop(request.request_id, None)
            self._forget_slot(request.request_id)
            if self.kv_tiers is not None:
                self.kv_tiers.cancel(request.request_id)
        return [self._trackers.pop(r.request_id).output() for r in aborted]

    def snapshot(self) -> EngineSnapshot:
        """The counters now, copied (call it on the thread that drives this engine)."""
        s, kv, st = self.scheduler, self.scheduler.kv, self.stats
        spec = None
        if self.num_speculative_tokens:
            spec = dataclasses.replace(st.spec, verified_by_position=list(st.spec.verified_by_position),
                                       accepted_by_position=list(st.spec.accepted_by_position))
        return EngineSnapshot(len(s.running), len(s.waiting), kv.pool.num_blocks - kv.num_free_blocks,
                              kv.pool.num_blocks, kv.num_prefix_queries, kv.num_prefix_hits, st.num_steps,
                              st.num_prompt_tokens, st.num_generation_tokens, self.num_speculative_tokens, spec,
                              self.kv_tiers.snapshot() if self.kv_tiers is not None else None,
                              self.swa_slots.snapshot() if self.swa_slots is not None else None,
                              SWAReplayCounts(self.swa_replay_mode, self.num_replays, self.num_replayed_tokens)
                              if self.replay_snapshot is not None else None)

    def has_unfinished_requests(self) -> bool:
        """True until every request is done *and* the runner has dropped their state."""
        s = self.scheduler
        return s.has_unfinished_requests() or s.has_unreported_finishes or self._in_flight is not None

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan step N and launch it; finish step N-1 on the host while N runs. Returns updated requests."""
        outputs = self._check_grammars()
        if self.kv_tiers is not None:
            self._place_loaded_blocks()
        plan = self.scheduler.schedule()
        masks = self._plan_masks(plan)
        step_input = self._step_input(plan, masks)
        if masks is not None and self._in_flight is None:
            outputs += self._fill_masks(masks)  # nothing in flight: the matchers are up to date, fill before launch
        copies, self._copies_in = self._copies_in, []
        restores, replays = self._slot_restores(step_input), self._snapshot_replays(step_input)
        launched = (plan, self._worker.submit(self._run, step_input, copies, restores, replays)) \
            if plan.chunks or plan.finished_request_ids or plan.preempted_request_ids else None
        if launched is None:
            self._copies_in = copies
        outputs += self._finish_in_flight(masks)
        self._in_flight = launched
        if masks is not None and not masks.masks.bitmask.done():
            outputs += self._fill_masks(masks)  # step N-1's tokens are consumed: fill step N's masks
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._finish(*self._in_flight)
            self._in_flight = None
        if launched is None and self._compiling:  # nothing could run: wait a little for a grammar
            wait([t.grammar.future for t in self._compiling.values()], _GRAMMAR_POLL_SECONDS, FIRST_COMPLETED)
        elif launched is None and self.kv_tiers is not None and self.kv_tiers.num_loading:
            self.kv_tiers.wait(_GRAMMAR_POLL_SECONDS)  # nothing could run: wait a little for a prefix load
        return outputs

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
        if self._froze_gc:
            self._froze_gc = False
            gc.unfreeze()  # (what died since is collectable again)
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.kv_tiers is not None:
            self.kv_tiers.close()  # the store writes in flight finish (each within the store's deadline)

    def _run(self, step: StepInput, copies: list[tuple[list[int], list]] = (), restores=(), replays=()) \
            -> StepOutput:
        began = time.perf_counter()
        if self._last_end is not None and step.chunks:
            self.stats.host_gaps.append(began - self._last_end)
        for pages, blocks in copies:  # blocks loaded from a lower tier, into their pages before anything reads them
            self.page_io.write(pages, blocks)
        for table, boundary, token_ids in replays:  # after the pages, before the step restores from them
            self.num_replayed_tokens += self.replay_snapshot(table, boundary, token_ids)
            self.num_replays += 1
        for request_id, table, num_tokens, payload in restores:  # after the pages: a restore starts from them
            self.slot_io.restore_sequence(request_id, table, num_tokens, payload)
        out = self.executor.execute(step)
        self._last_end = time.perf_counter()
        return out

    def _finish_in_flight(self, masks: _PendingMasks | None) -> list[RequestOutput]:
        if self._in_flight is None:
            return []
        try:
            return self._finish(*self._in_flight)
        except BaseException as exc:
            if masks is not None and not masks.masks.bitmask.done():
                masks.masks.bitmask.set_exception(exc)  # the runner waits on it: never leave it hanging
            raise

    def _step_input(self, plan: SchedulerOutput, masks: _PendingMasks | None = None) -> StepInput:
        chunks = []
        requests, trackers, tables = self.scheduler.requests, self._trackers, self.scheduler.kv.block_tables
        P, snapshots = self.page_size, self.enable_prefix_caching
        for c in plan.chunks:
            request = requests[c.request_id]
            tracker = trackers[c.request_id]
            params = request.sampling_params
            end = c.start + len(c.token_ids)
            blocked = ()
            if c.samples and params.min_tokens:  # (none blocked once min_tokens are out, nor ever without any)
                before = request.num_output_tokens + request.num_pending_tokens - 1
                blocked = tuple(min_tokens_blocked_ids(params, self.scheduler.eos_token_ids, before))
            targets = ()
            if params.prompt_logprobs is not None and c.start < request.num_prompt_tokens - 1:
                targets = tuple(request.prompt_token_ids[c.start + 1 : min(end, request.num_prompt_tokens - 1) + 1])
            table = tuple(tables.get(c.request_id, ()))
            snaps = ()
            first = (c.start // P + 1) * P  # the first page boundary past the chunk's start
            if snapshots and not c.relative and first <= end:  # a relative chunk's runner finds its boundaries
                snaps = tuple((b, table[b // P - 1]) for b in range(first, end + 1, P))
            speculate = next_token = None
            if self.num_speculative_tokens:
                speculate = self.num_speculative_tokens if c.samples and self._may_draft(tracker) else 0
                if c.samples:
                    self.scheduler.drafts_in_flight(c.request_id, speculate)
                else:
                    next_token = request.all_token_ids[end]
            history = prompt = ()
            if c.samples and tracker.reads_output_history:  # a copy: this thread appends while the step runs
                history = tuple(request.output_token_ids)
                prompt = request.prompt_token_ids if params.repetition_penalty != 1.0 else ()
            chunks.append(ChunkInput(c.request_id, c.start, c.token_ids, c.samples, table, params, tracker.seed,
                                     blocked, targets, snaps, c.num_draft_tokens, next_token, speculate or 0,
                                     c.relative, c.forced_drafts, history, prompt))
        return StepInput(tuple(chunks), plan.finished_request_ids + plan.preempted_request_ids,
                         masks.masks if masks is not None else None)

    def _may_draft(self, tracker: RequestTracker) -> bool:
        """Requests whose next tokens need per-token host work do not draft: logprobs, and min_tokens still
        blocking stop ids (grammars draft: `fill_draft_masks` masks every verified position)."""
        request, params = tracker.request, tracker.request.sampling_params
        return params.logprobs is None and request.num_output_tokens + 1 >= params.min_tokens

    def _finish(self, plan: SchedulerOutput, future: Future) -> list[RequestOutput]:
        out: StepOutput = future.result()
        out.resolve()  # the runner may return before the samples reach the host; fails as `execute` would
        self.stats.num_steps += 1
        self.stats.step_seconds.append(out.seconds)
        if out.mask_wait_seconds:
            self.stats.mask_wait_seconds.append(out.mask_wait_seconds)
        if self.cost_model is not None and plan.chunks:
            seconds = max(out.seconds - out.mask_wait_seconds, 1e-9)  # the model's time, not the host's
            self.cost_model.observe([(len(c.token_ids), c.start) for c in plan.chunks], seconds)
        if self.verify_planner is not None and plan.chunks:
            self.verify_planner.observe(plan.num_scheduled_tokens, max(out.seconds - out.mask_wait_seconds, 1e-9))
        if self.num_speculative_tokens:
            self._record_speculation(plan, out)
        self.scheduler.update_from_output(plan, out.sampled, out.num_accepted, out.draft_token_ids,
                                          out.draft_confidences)
        if self.kv_tiers is not None:
            self._offload_new_blocks()
        touched: dict[str, RequestTracker] = {}
        verdicts: dict[str, tuple[str, str | None]] = {}
        self._cut_short: set[str] = set()
        trackers, prompt_logprobs, logprobs, sampled_logprobs = (self._trackers, out.prompt_logprobs, out.logprobs,
                                                                 out.sampled_logprobs)
        for c in plan.chunks:
            request_id = c.request_id
            tracker = trackers.get(request_id)
            if tracker is None:
                continue  # aborted or finished while this step ran
            if prompt_logprobs and request_id in prompt_logprobs:
                tracker.add_prompt_logprobs(c.start, prompt_logprobs[request_id])
            if c.samples:
                verdict = self._absorb(tracker, logprobs.get(request_id) if logprobs else None,
                                       sampled_logprobs.get(request_id) if sampled_logprobs else None)
                if verdict is not None:
                    verdicts[request_id] = verdict
            request = tracker.request
            if c.start + len(c.token_ids) >= request.num_prompt_tokens > c.start:
                self.stats.num_prompt_tokens += request.num_prompt_tokens - request.num_cached_tokens
            touched[request_id] = tracker
        outputs = []
        for request_id, tracker in touched.items():
            request = tracker.request
            reason = ("stop", tracker.stop_match.stop) if tracker.stop_match is not None else verdicts.get(request_id)
            if reason is not None and not request.is_finished:
                self.scheduler.finish_requests([request_id], *reason)
            elif reason is not None and request_id in self._cut_short:
                request.finish(*reason)  # plain decoding would have stopped here, before what ended it
            if request.is_finished:
                del trackers[request_id]
                self._queue_slot_save(request)
                outputs.append(tracker.output())
                continue
            if tracker.grammar is not None and self.num_speculative_tokens:
                self._force_drafts(tracker)
            if not tracker.final_only:
                outputs.append(tracker.output())
        return outputs

    def _force_drafts(self, tracker: RequestTracker) -> None:
        """Draft the tokens the grammar forces next (a JSON schema's keys and punctuation) instead of the
        drafter's: their mask allows little or nothing else, so they are nearly always kept. Only where the
        request's next chunk is planned from now on (no step for it in flight: synchronous scheduling, or a
        pipeline gap); a step already planned verifies the drafter's drafts as placeholders, and the forced
        tokens would be for positions that step fills anyway."""
        request, matcher = tracker.request, tracker.grammar.matcher
        if (matcher is None or request.num_pending_tokens or request.num_inflight_verifies
                or request.status is not RequestStatus.RUNNING or not self._may_draft(tracker)):
            return
        forced = matcher.forced_tokens()[: self.num_speculative_tokens]
        if forced:
            self.stats.spec.num_draft_tokens += len(forced) - len(request.spec_token_ids)
            self.stats.spec.num_forced_draft_tokens += len(forced)
            self.scheduler.force_drafts(request.request_id, forced)

    def _absorb(self, tracker: RequestTracker, logprobs, sampled_logprob) -> tuple[str, str | None] | None:
        """Take the tokens the scheduler just appended (one, or several with kept drafts), one at a time, as plain
        decoding would: stop at a stop string or at the grammar's end. Returns the grammar's verdict, if any."""
        request, grammar = tracker.request, tracker.grammar
        output = request.output_token_ids
        verdict = None
        num_absorbed = 0
        while tracker.absorb(logprobs, sampled_logprob):
            logprobs = sampled_logprob = None
            num_absorbed += 1
            if tracker.stop_match is not None:
                break
            more = tracker.num_seen < len(output)
            if grammar is not None and grammar.matcher is not None and (more or not request.is_finished):
                verdict = grammar.advance(output, tracker.num_seen)
                if verdict is not None:
                    break
        self.stats.num_generation_tokens += num_absorbed
        if tracker.num_seen < len(output):  # kept drafts past the end: never generated
            del output[tracker.num_seen:]
            self._cut_short.add(request.request_id)
        return verdict

    def _record_speculation(self, plan: SchedulerOutput, out: StepOutput) -> None:
        spec = self.stats.spec
        for c in plan.chunks:
            request = self.scheduler.requests.get(c.request_id)
            if c.samples and request is not None and c.start >= request.num_prompt_tokens:  # a decode
                spec.record(c.num_draft_tokens, out.num_accepted.get(c.request_id, 0))
        spec.num_draft_tokens += sum(map(len, out.draft_token_ids.values()))

    # -- SWA host slots ------------------------------------------------------------------------------------------
    def _find_slot(self, request: Request, session_id: str | None) -> None:
        """Look up the slot the request continues (a miss on any doubt: the request then computes its tail).
        Saves still on the runner's thread are waited for first, so a conversation's next turn, sent the moment
        its previous turn's response arrived, finds that turn's slot: at most the step in flight (the save runs
        right after it), and only when a save is pending. The wait cannot deadlock: between `step()` calls the
        step in flight waits on nothing of this thread's (its grammar masks are filled before `step()` returns)."""
        rid = request.request_id
        self._sessions[rid] = session_id
        if request.sampling_params.prompt_logprobs is not None or not self.enable_prefix_caching:
            return
        pending, self._slot_saves = [f for f in self._slot_saves if not f.done()], []
        if pending:
            wait(pending)
        resume = self.swa_slots.find(session_id, request.prompt_token_ids, request.cache_salt)
        if resume is not None:
            self._resumes[rid] = resume
            self.scheduler.resume_from_slot(rid, resume.base_tokens, resume.num_tokens)

    def _forget_slot(self, request_id: str) -> None:
        self._sessions.pop(request_id, None)
        self._resumes.pop(request_id, None)
        self._continued.pop(request_id, None)

    def _queue_slot_save(self, request: Request) -> None:
        """A finished request's state goes to a slot (not an aborted one's), on the runner's thread now: after the
        step in flight (whose plan did not know of the finish, so it frees nothing of the request's) and before
        the next, whose plan reports the finish and so frees the request's state. Not with the next launch: a
        next turn arriving before it would miss the slot."""
        session_id = self._sessions.pop(request.request_id, None)
        self._resumes.pop(request.request_id, None)
        continued = self._continued.pop(request.request_id, None)
        if self.swa_slots is not None and request.finish_reason != "abort":
            self._slot_saves = [f for f in self._slot_saves if not f.done()]
            self._slot_saves.append(self._worker.submit(self._save_slot, request.request_id, session_id,
                                                        tuple(request.all_token_ids), request.cache_salt, continued))

    def _slot_restores(self, step: StepInput) -> list[tuple[str, list[int], int, bytes]]:
        """The slots this step's first chunks restore: a request the scheduler admitted at its slot's length."""
        if not self._resumes:
            return []
        restores = []
        for c in step.chunks:
            resume = self._resumes.pop(c.request_id, None)
            if resume is None:
                continue
            applied = c.start == resume.num_tokens
            self.swa_slots.record_restore(applied)
            if applied:
                self._continued[c.request_id] = resume.key
                restores.append((c.request_id, list(c.block_table), resume.num_tokens, resume.payload))
        return restores

    def _snapshot_replays(self, step: StepInput) -> list[tuple[list[int], int, tuple[int, ...]]]:
        """The SWA replays this step needs, (table, boundary, token ids): a request admitted with a prefix hit
        whose last page came without its window snapshot (a store that keeps none) has it rebuilt before the step
        reads it."""
        if self.replay_snapshot is None:
            return []
        replays = []
        for c in step.chunks:
            replay = self.scheduler.kv.take_snapshot_replay(c.request_id)
            if replay is not None and c.start == replay[0]:  # else an SWA slot restores past it
                self.scheduler.kv.snapshot_replayed(replay[1][-1])
                tokens = tuple(self.scheduler.requests[c.request_id].all_token_ids[: replay[0]])
                replays.append((list(c.block_table), replay[0], tokens))
        return replays

    def _save_slot(self, request_id: str, session_id: str | None, token_ids: tuple[int, ...],
                   salt: str | None, continued: str | None) -> None:
        try:
            saved = self.slot_io.save_sequence(request_id)
            if saved is not None and saved[0] <= len(token_ids):
                self.swa_slots.save(session_id, token_ids[: saved[0]], salt, saved[1], replaces=continued)
        except Exception:  # noqa: BLE001 - a slot is an optimization: losing one never fails anything
            logger.exception("saving the SWA host slot of request %s failed", request_id)

    # -- cache tiers -----------------------------------------------------------------------------------------------
    def _start_kv_load(self, request: Request) -> bool:
        """Ask the tiers below the GPU for the request's prefix blocks past those the GPU holds; True when the
        request must wait for them. Not for a request that wants its prompt's logprobs (it takes no hits)."""
        if (self.kv_tiers is None or not self.enable_prefix_caching
                or request.sampling_params.prompt_logprobs is not None):
            return False
        max_blocks = max(request.num_prompt_tokens - 1, 0) // self.page_size  # a hit leaves one token to compute
        hashes = block_hashes(request.prompt_token_ids[: max_blocks * self.page_size], self.page_size,
                              request.cache_salt)
        first = self.scheduler.kv.cached_prefix_length(hashes)
        return self.kv_tiers.start_load(request.request_id, hashes, first)

    def _place_loaded_blocks(self) -> None:
        """Put each finished load's blocks into free pages (written by the next step before its forward) and let
        its request be admitted, with them as prefix hits."""
        kv = self.scheduler.kv
        for load in self.kv_tiers.poll():
            if load.request_id not in self.scheduler.requests:
                continue  # finished (aborted) while it loaded
            blocks = load.blocks()
            request = self.scheduler.requests[load.request_id]
            new = kv.prepare_load(load.request_id, load.block_hashes[: load.first + len(blocks)], load.first,
                                  request.prompt_token_ids, request.sampling_params.cache_ttl)
            if new:
                self._copies_in.append(([page for _, page in new], [blocks[i - load.first] for i, _ in new]))
                kv.mark_unsnapshotted([page for i, page in new if len(blocks[i - load.first]) < len(
                    self.kv_tiers.pool_bytes)])  # a store without window snapshots: replayed on a hit
            self.kv_tiers.record(load, len(new))
            self.scheduler.kv_loaded(load.request_id)

    def _offload_new_blocks(self) -> None:
        """Copy the blocks the step completed out of their pages (on the runner's thread, after the step in
        flight and before the next one, which may reuse a page) into the tiers below."""
        new = self.scheduler.kv.take_new_blocks()
        if self.kv_tiers.store is None:  # only a store keeps retention classes: nothing to write again
            new = [b for b in new if not b.reput]
        if new:
            self._worker.submit(self._copy_out, new)

    def _copy_out(self, new: list) -> None:
        try:
            self.kv_tiers.offload([b.block_hash for b in new], self.page_io.read([b.page for b in new]),
                                  [b.ttl_class for b in new], [b.reput for b in new])
        except Exception:  # noqa: BLE001 - writes are best effort: a failed copy is a block not offloaded
            logger.exception("copying %d KV blocks out to the cache tiers failed", len(new))

    # -- structured output ---------------------------------------------------------------------------------------
    def _check_grammars(self) -> list[RequestOutput]:
        """Give each request whose grammar compiled its matcher; finish those whose compile failed or timed out."""
        outputs = []
        now = time.monotonic()
        for request_id, tracker in list(self._compiling.items()):
            grammar = tracker.grammar
            if not grammar.future.done() and now < grammar.deadline:
                continue
            del self._compiling[request_id]
            try:
                if not grammar.future.done():
                    raise GrammarTimeout(timeout_message(grammar.spec, self.grammars.timeout))
                compiled = grammar.future.result()
                grammar.backend, grammar.matcher = compiled.backend, compiled.new_matcher()
            except Exception as exc:  # noqa: BLE001 - any failure of the user's grammar ends only this request
                outputs.append(self._finish_request(tracker, "abort", f"{GRAMMAR_ERROR_PREFIX}{exc}"))
                continue
            self.scheduler.grammar_ready(request_id)
            if grammar.matcher.is_terminated():  # a grammar that only accepts the empty string
                outputs.append(self._finish_request(tracker, "stop", None))
        return outputs

    def _finish_request(self, tracker: RequestTracker, reason: str, stop_reason: str | None) -> RequestOutput:
        self.scheduler.finish_requests([tracker.request.request_id], reason, stop_reason)
        self._forget_slot(tracker.request.request_id)
        if self.kv_tiers is not None:
            self.kv_tiers.cancel(tracker.request.request_id)
        del self._trackers[tracker.request.request_id]
        return tracker.output()

    def _plan_masks(self, plan: SchedulerOutput) -> _PendingMasks | None:
        rows = [(i, c) for i, c in enumerate(plan.chunks)
                if c.samples and self._trackers[c.request_id].grammar is not None]
        if not rows:
            return None
        drafts = tuple(c.token_ids[len(c.token_ids) - c.num_draft_tokens:] for _, c in rows)
        per_chunk = tuple(1 + len(d) for d in drafts) if any(drafts) else ()
        return _PendingMasks(tuple(c.request_id for _, c in rows),
                             StepMasks(tuple(i for i, _ in rows), Future(), per_chunk), drafts)

    def _fill_masks(self, pending: _PendingMasks) -> list[RequestOutput]:
        """Fill the bitmask rows of a launched step and hand it to the runner; finish requests at a dead end."""
        began = time.perf_counter()
        live: dict[int, RequestTracker] = {}
        by_backend: dict[GrammarBackend, list[tuple[GrammarMatcher, int]]] = {}
        verifying: list[tuple[GrammarMatcher, tuple[int, ...], int]] = []
        row = 0
        for i, request_id in enumerate(pending.request_ids):
            planned = pending.drafts[i] if pending.drafts else ()
            tracker = self._trackers.get(request_id)
            drafts = planned
            if DRAFT_PLACEHOLDER in planned and tracker is not None:  # the drafts of the step just applied
                drafts = tuple(tracker.request.spec_token_ids[: len(planned)])
            if tracker is not None and not tracker.request.is_finished and len(drafts) == len(planned):
                live[row] = tracker  # else its sample is discarded
                if drafts:
                    verifying.append((tracker.grammar.matcher, drafts, row))
                else:
                    by_backend.setdefault(tracker.grammar.backend, []).append((tracker.grammar.matcher, row))
            row += 1 + len(planned)
        try:
            backends = list(by_backend) or [live[r].grammar.backend for _, _, r in verifying]
            bitmask = backends[0].allocate_bitmask(row) if backends else None
            dead = [row for backend, rows in by_backend.items() for row in backend.fill_bitmasks(bitmask, rows)]
            for matcher, drafts, first_row in verifying:
                matcher.fill_draft_masks(drafts, bitmask, first_row)
        except BaseException as exc:
            pending.masks.bitmask.set_exception(exc)  # the runner waits on it: never leave it hanging
            raise
        pending.masks.bitmask.set_result(bitmask)
        self.stats.mask_fill_seconds.append(time.perf_counter() - began)
        outputs = []
        for row in dead:  # the runner samples them unmasked; finishing the request now discards that token
            why = live[row].grammar.matcher.error_message() or "no token is allowed"
            outputs.append(self._finish_request(live[row], "abort", f"{GRAMMAR_ERROR_PREFIX}dead end: {why}"))
        return outputs
