"""The scheduler with a real KV manager and one fake at the edge: a "model" whose next token is a hash of the
token sequence it reads back from the KV pages. Serving many requests together (with chunking, prefix hits,
preemption and aborts) must give each one exactly the tokens it gets alone."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from deepserve.core.kv import KVCacheManager
from deepserve.core.request import Request, RequestStatus
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.scheduler import CostCoefficients, CostModelConfig, StepCostModel
from deepserve.core.scheduler.scheduler import PLACEHOLDER, Scheduler, SchedulerOutput
from deepserve.core.stop_checker import check_stop

BLOCK = 128
VOCAB = 97
EOS = 0
MAX_MODEL_LEN = 4096


def next_token(tokens: list[int]) -> int:
    return hash(tuple(tokens)) % VOCAB  # int tuples hash deterministically across runs


def reference(request: Request) -> list[int]:
    """The tokens the fake model gives this request alone, stop rules applied."""
    seq, out = list(request.prompt_token_ids), []
    while True:
        token = next_token(seq)
        seq.append(token)
        out.append(token)
        if check_stop(token, len(out), len(seq), request.sampling_params, {EOS}, MAX_MODEL_LEN)[0]:
            return out


class FakeRunner:
    """Writes each chunk's tokens into the pages of the request's block table and samples from what the pages
    hold, so a wrong page, a stale prefix hit or a skipped token changes the output."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.pages: dict[int, list[int | None]] = {}

    def execute(self, out: SchedulerOutput, previous: dict[str, int] | None = None) -> dict[str, int]:
        """`previous`: the last step's samples, which stand in for PLACEHOLDER ids (asynchronous scheduling)."""
        sampled = {}
        for chunk in out.chunks:
            table = self.kv.block_tables[chunk.request_id]
            tokens = [previous[chunk.request_id] if t == PLACEHOLDER else t for t in chunk.token_ids]
            for pos, token in enumerate(tokens, start=chunk.start):
                self.pages.setdefault(table[pos // BLOCK], [None] * BLOCK)[pos % BLOCK] = token
            if chunk.samples:
                end = chunk.start + len(chunk.token_ids)
                seq = [self.pages[table[pos // BLOCK]][pos % BLOCK] for pos in range(end)]
                assert None not in seq
                sampled[chunk.request_id] = next_token(seq)
        return sampled


@dataclass
class Run:
    finished: dict[str, Request]
    steps: int
    num_scheduled_tokens: int
    scheduler: Scheduler


def make_requests(n: int, seed: int, max_prompt: int = 600, max_output: int = 40,
                  shared_prefix: list[int] | None = None) -> list[tuple[int, Request]]:
    """(arrival step, request) pairs with random prompt and output lengths; some use stop token ids."""
    rng = random.Random(seed)
    prefix = shared_prefix or []
    out = []
    for i in range(n):
        prompt = prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        params = SamplingParams(max_tokens=rng.randint(1, max_output),
                                stop_token_ids=[5] if i % 5 == 0 else None)
        out.append((rng.randint(0, 30), Request(f"r{i}", prompt, params)))
    return out


def make_scheduler(num_blocks: int = 1024, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                   cost_model: StepCostModel | None = None, prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, cost_model, max_num_seqs, max_num_batched_tokens, MAX_MODEL_LEN, eos_token_ids={EOS})


def serve(scheduler: Scheduler, arrivals: list[tuple[int, Request]],
          aborts: dict[int, list[str]] | None = None, abort_mid_step: dict[int, list[str]] | None = None) -> Run:
    runner = FakeRunner(scheduler.kv)
    pending = sorted(arrivals, key=lambda a: a[0])
    finished: dict[str, Request] = {}
    step = total = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        for request in scheduler.abort((aborts or {}).get(step, [])):
            finished[request.request_id] = request
        out = scheduler.schedule()
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert len(out.chunks) <= scheduler.max_num_seqs
        assert out.num_scheduled_tokens <= scheduler.max_num_batched_tokens
        total += out.num_scheduled_tokens
        sampled = runner.execute(out)
        for request in scheduler.abort((abort_mid_step or {}).get(step, [])):
            finished[request.request_id] = request
        for request in scheduler.update_from_output(out, sampled):
            finished[request.request_id] = request
        step += 1
        assert step < 200_000, "the scheduler stopped making progress"
    return Run(finished, step, total, scheduler)


def serve_pipelined(scheduler: Scheduler, arrivals: list[tuple[int, Request]],
                    aborts: dict[int, list[str]] | None = None) -> Run:
    """Asynchronous scheduling as the engine does it: step N is planned (and run) before step N-1's samples
    are applied, so N computes N-1's tokens as placeholders."""
    runner = FakeRunner(scheduler.kv)
    pending = sorted(arrivals, key=lambda a: a[0])
    finished: dict[str, Request] = {}
    in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None
    step = total = num_placeholders = 0
    while pending or scheduler.has_unfinished_requests() or in_flight:
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        for request in scheduler.abort((aborts or {}).get(step, [])):
            finished[request.request_id] = request
        out = scheduler.schedule()
        assert out.num_scheduled_tokens <= scheduler.max_num_batched_tokens
        num_placeholders += sum(t == PLACEHOLDER for c in out.chunks for t in c.token_ids)
        sampled = runner.execute(out, in_flight[1] if in_flight else None)
        total += out.num_scheduled_tokens
        if in_flight is not None:
            for request in scheduler.update_from_output(*in_flight):
                finished[request.request_id] = request
        in_flight = (out, sampled) if out.chunks else None
        step += 1
        assert step < 200_000, "the scheduler stopped making progress"
    assert num_placeholders > 0
    return Run(finished, step, total, scheduler)


@pytest.mark.parametrize("num_blocks", [1024, 8])
def test_asynchronous_scheduling_gives_the_same_tokens(num_blocks):
    arrivals = make_requests(48, seed=9)
    run = serve_pipelined(make_scheduler(num_blocks=num_blocks), arrivals)
    assert_all_match_reference(run, arrivals)
    if num_blocks == 8:
        assert run.scheduler.num_preemptions > 0


def test_asynchronous_scheduling_with_aborts_frees_everything():
    arrivals = make_requests(32, seed=10)
    rng = random.Random(3)
    aborts: dict[int, list[str]] = {}
    for _, request in arrivals[::3]:
        aborts.setdefault(rng.randint(0, 60), []).append(request.request_id)
    run = serve_pipelined(make_scheduler(num_blocks=16), arrivals, aborts)
    for _, request in arrivals:
        ref = reference(request)
        assert request.output_token_ids == ref[: len(request.output_token_ids)]
    assert run.scheduler.kv.num_free_blocks == run.scheduler.kv.pool.num_blocks and not run.scheduler.kv.block_tables


def assert_all_match_reference(run: Run, arrivals: list[tuple[int, Request]]) -> None:
    assert len(run.finished) == len(arrivals)
    for _, request in arrivals:
        assert run.finished[request.request_id] is request
        assert request.output_token_ids == reference(request), request.request_id
    assert run.scheduler.kv.num_free_blocks == run.scheduler.kv.pool.num_blocks
    assert not run.scheduler.kv.block_tables


def test_64_requests_served_together_match_each_served_alone():
    arrivals = make_requests(64, seed=1)
    run = serve(make_scheduler(), arrivals)
    assert_all_match_reference(run, arrivals)
    reasons = {r.finish_reason for _, r in arrivals}
    assert reasons == {"stop", "length"}
    assert all(r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) for _, r in arrivals)
    assert any(r.stop_reason == 5 for _, r in arrivals)


def test_tiny_kv_pool_forces_preemption_with_identical_outputs():
    arrivals = make_requests(64, seed=2)
    # 6 pages hold the longest request (600 + 40 tokens), but not many requests at once
    run = serve(make_scheduler(num_blocks=8), arrivals)
    assert_all_match_reference(run, arrivals)
    assert run.scheduler.num_preemptions > 0
    assert any(r.num_preemptions for _, r in arrivals)


@pytest.mark.parametrize("budget", [1, 2, 7, 128, 129, 1000, 100_000])
def test_chunk_budgets_from_one_up_give_identical_outputs(budget):
    arrivals = make_requests(24 if budget < 8 else 64, seed=3, max_prompt=300 if budget < 8 else 600)
    run = serve(make_scheduler(max_num_batched_tokens=budget), arrivals)
    assert_all_match_reference(run, arrivals)


def test_cost_model_sizes_prefill_chunks_with_identical_outputs():
    # a prior that makes ~50 tokens fill the 1 ms step target
    config = CostModelConfig(step_time_target=1e-3, prior=CostCoefficients(a=0.0, b=2e-5, c=0.0, d=0.0))
    cost_model = StepCostModel(config)
    arrivals = make_requests(32, seed=4)
    scheduler = make_scheduler(cost_model=cost_model)
    chunk_sizes = []
    real_schedule = scheduler.schedule

    def schedule() -> SchedulerOutput:
        out = real_schedule()
        chunk_sizes.extend(len(c.token_ids) for c in out.chunks)
        # decodes are not sized by the model and a prefill always gets >= 1 token, else the step fits 50 tokens
        assert out.num_scheduled_tokens <= 50 + len(out.chunks)
        return out

    scheduler.schedule = schedule
    run = serve(scheduler, arrivals)
    assert_all_match_reference(run, arrivals)
    assert max(chunk_sizes) == 50


def test_abort_at_random_times_frees_everything():
    arrivals = make_requests(64, seed=5)
    rng = random.Random(5)
    aborts: dict[int, list[str]] = {}
    mid_step: dict[int, list[str]] = {}
    victims = rng.sample([r.request_id for _, r in arrivals], 24)
    for i, request_id in enumerate(victims):
        (aborts if i % 2 else mid_step).setdefault(rng.randint(0, 80), []).append(request_id)
    run = serve(make_scheduler(num_blocks=12), arrivals, aborts, mid_step)
    assert len(run.finished) == len(arrivals)
    num_aborted = 0
    for _, request in arrivals:
        expected = reference(request)
        if request.finish_reason == "abort":
            num_aborted += 1
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == expected[:request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
    assert num_aborted > 0
    assert run.scheduler.kv.num_free_blocks == run.scheduler.kv.pool.num_blocks
    assert not run.scheduler.kv.block_tables and not run.scheduler.requests


def test_abort_reports_finished_ids_and_ignores_unknown():
    scheduler = make_scheduler()
    request = Request("a", list(range(1, 300)), SamplingParams(max_tokens=4))
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert scheduler.abort(["a", "nope"]) == [request]
    assert scheduler.update_from_output(out, {"a": 1}) == []
    assert request.num_output_tokens == 0 and request.finish_reason == "abort"
    assert scheduler.schedule().finished_request_ids == ("a",)
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_blocks


def test_shared_prefix_hits_skip_compute_with_identical_outputs():
    rng = random.Random(6)
    prefix = [rng.randrange(1, VOCAB) for _ in range(3 * BLOCK + 37)]
    arrivals = make_requests(32, seed=6, max_prompt=200, shared_prefix=prefix)
    arrivals[0] = (0, arrivals[0][1])
    arrivals[1:] = [(step + 5, r) for step, r in arrivals[1:]]  # the first has filled the cache by then
    cold = [(step, Request(r.request_id, r.prompt_token_ids, r.sampling_params)) for step, r in arrivals]

    warm_run = serve(make_scheduler(), arrivals)
    cold_run = serve(make_scheduler(prefix_caching=False), cold)
    assert_all_match_reference(warm_run, arrivals)
    assert_all_match_reference(cold_run, cold)
    hits = [r.num_cached_tokens for _, r in arrivals[1:]]
    assert all(h >= 3 * BLOCK for h in hits)
    assert all(r.num_cached_tokens == 0 for _, r in cold)
    assert warm_run.num_scheduled_tokens <= cold_run.num_scheduled_tokens - sum(hits)


def test_cache_salt_isolates_prefix_hits():
    prompt = [7] * (2 * BLOCK + 5)
    scheduler = make_scheduler()
    arrivals = [(0, Request("a", prompt, SamplingParams(max_tokens=3), cache_salt="x")),
                (10, Request("b", prompt, SamplingParams(max_tokens=3), cache_salt="y")),
                (10, Request("c", prompt, SamplingParams(max_tokens=3), cache_salt="x"))]
    run = serve(scheduler, arrivals)
    assert_all_match_reference(run, arrivals)
    assert [r.num_cached_tokens for _, r in arrivals] == [0, 0, 2 * BLOCK]


def test_max_num_seqs_limits_the_batch():
    arrivals = [(0, r) for _, r in make_requests(20, seed=7, max_prompt=50)]
    scheduler = make_scheduler(max_num_seqs=3)
    for _, request in arrivals:
        scheduler.add_request(request)
    run = serve(scheduler, [])  # serve() asserts the limits every step
    assert len(run.finished) == 20


def test_token_budget_limits_each_step_and_decodes_go_first():
    scheduler = make_scheduler(max_num_batched_tokens=100)
    short = Request("short", [1, 2, 3], SamplingParams(max_tokens=10))
    scheduler.add_request(short)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"short": 9})
    assert out.chunks[0].samples and short.output_token_ids == [9]
    scheduler.add_request(Request("long", list(range(1, 500)), SamplingParams(max_tokens=2)))
    out = scheduler.schedule()
    assert [(c.request_id, c.start, len(c.token_ids), c.samples) for c in out.chunks] == [
        ("short", 3, 1, True), ("long", 0, 99, False)]
    assert out.num_scheduled_tokens == 100


def test_add_request_validates():
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1], SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("a", [1], SamplingParams()))
    with pytest.raises(ValueError, match="no room"):
        scheduler.add_request(Request("b", [1] * MAX_MODEL_LEN, SamplingParams()))
    with pytest.raises(ValueError, match="empty prompt"):
        Request("c", [], SamplingParams())


def test_out_of_pages_preempts_the_newest_running_request():
    scheduler = make_scheduler(num_blocks=3)
    old = Request("old", [3] * (BLOCK - 1), SamplingParams(max_tokens=5, ignore_eos=True))
    new = Request("new", [4] * (2 * BLOCK - 6), SamplingParams(max_tokens=5, ignore_eos=True))
    arrivals = [(0, old), (0, new)]
    scheduler.add_request(old)
    scheduler.add_request(new)
    for _ in range(2):  # both fit: 1 + 2 pages
        out = scheduler.schedule()
        assert not out.preempted_request_ids
        scheduler.update_from_output(out, {c.request_id: 1 for c in out.chunks if c.samples})
    out = scheduler.schedule()  # "old" crosses into a second page: the newest request must make room
    assert out.preempted_request_ids == ("new",)
    assert [c.request_id for c in out.chunks] == ["old"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new
    fresh = [(0, Request(r.request_id, r.prompt_token_ids, r.sampling_params)) for _, r in arrivals]
    run = serve(make_scheduler(num_blocks=3), fresh)  # the same pair served to the end, preemption included
    assert_all_match_reference(run, fresh)
    assert run.scheduler.num_preemptions > 0


def test_a_request_that_finishes_in_its_first_step_leaves_its_prompt_cached():
    scheduler = make_scheduler()
    prompt = list(range(1, 301))
    first = Request("first", prompt, SamplingParams(max_tokens=1))
    scheduler.add_request(first)
    out = scheduler.schedule()
    assert scheduler.update_from_output(out, {"first": 3}) == [first]
    second = Request("second", prompt + [7], SamplingParams(max_tokens=1))
    scheduler.add_request(second)
    scheduler.schedule()
    assert second.num_cached_tokens == 256
