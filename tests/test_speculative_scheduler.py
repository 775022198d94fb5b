"""Draft bookkeeping in the scheduler (plain Python, real KV manager): drafts are catch-up tokens, rejected ones
move `num_computed_tokens` back, kept ones are appended through the stop rules, and the planner and the limits
trim what is verified."""

from __future__ import annotations

from deepserve.core.kv import KVCacheManager
from deepserve.core.request import Request
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.scheduler.scheduler import Scheduler


def make(max_tokens=20, planner=None, max_model_len=4096):
    kv = KVCacheManager(8, 128, True)
    scheduler = Scheduler(kv, None, 4, 64, max_model_len, eos_token_ids={0}, verify_planner=planner)
    request = Request("r", list(range(10, 20)), SamplingParams(temperature=0, max_tokens=max_tokens))
    scheduler.add_request(request)
    plan = scheduler.schedule()  # the prompt
    scheduler.update_from_output(plan, {"r": 50}, drafts={"r": [51, 52, 53, 54]}, confidences={"r": [.9] * 4})
    return scheduler, request, kv


def test_drafts_ride_the_catch_up_and_rejections_move_it_back():
    scheduler, request, kv = make()
    assert request.spec_token_ids == [51, 52, 53, 54] and request.num_draft_tokens == 4
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.token_ids, chunk.samples, chunk.num_draft_tokens) == (10, (50, 51, 52, 53, 54), True, 4)
    assert len(kv.block_tables["r"]) == 1 and request.num_computed_tokens == 15  # pages for every verified token
    scheduler.update_from_output(plan, {"r": 77}, num_accepted={"r": 2}, drafts={"r": [78, 79, 80, 81]})
    assert request.output_token_ids == [50, 51, 52, 77]
    assert request.num_computed_tokens == 13  # 50, 51, 52 are in the cache; 77 is the next to compute
    assert (request.num_verified_tokens, request.num_accepted_tokens) == (4, 2)
    assert scheduler.schedule().chunks[0].token_ids == (77, 78, 79, 80, 81)


def test_limits_and_the_planner_trim_what_is_verified():
    scheduler, request, _ = make(max_tokens=3)  # 1 output so far, 2 to go: the step may keep 1 draft + 1 token
    assert scheduler.schedule().chunks[0].num_draft_tokens == 1
    scheduler, request, _ = make()
    scheduler.max_num_batched_tokens = 3  # the step's token budget holds the last token and 2 drafts
    assert scheduler.schedule().chunks[0].num_draft_tokens == 2
    seen = []

    def planner(confidences, other_tokens, other_outputs):
        seen.append((confidences, other_tokens, other_outputs))
        return [1]

    scheduler, request, _ = make(planner=planner)
    assert scheduler.schedule().chunks[0].token_ids == (50, 51)
    assert seen == [([[0.9] * 4], 0, 0)]  # the only running request drafts: no other work in the step


def test_a_stop_inside_kept_drafts_ends_the_request_there():
    scheduler, request, kv = make()
    request.spec_token_ids = [51, 0, 53, 54]  # the second draft is EOS
    plan = scheduler.schedule()
    finished = scheduler.update_from_output(plan, {"r": 9}, num_accepted={"r": 4}, drafts={"r": [1, 2, 3, 4]})
    assert finished == [request] and request.finish_reason == "stop"
    assert request.output_token_ids == [50, 51, 0]  # nothing after the EOS is appended
    assert not kv.block_tables and not scheduler.requests


def test_preemption_drops_the_drafts():
    scheduler, request, kv = make()
    scheduler._preempt(request, type("P", (), {"preempted": []})())
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0
    assert not kv.block_tables


def test_asynchronous_plans_verify_the_running_steps_drafts_as_placeholders():
    from deepserve.core.interfaces import DRAFT_PLACEHOLDER, PLACEHOLDER

    scheduler, request, kv = make()
    plan_n = scheduler.schedule()  # verifies 51..54 after token 50
    request.num_drafts_in_flight = 4  # the engine: step N drafts 4 more for it
    plan_next = scheduler.schedule()  # planned while N runs
    (chunk,) = plan_next.chunks
    assert chunk.relative and chunk.token_ids == (PLACEHOLDER,) + (DRAFT_PLACEHOLDER,) * 4
    assert request.num_computed_tokens == 20 and request.num_pending_tokens == 10  # upper bounds
    # N keeps 1 of its 4 drafts and makes the drafts N+1 is verifying
    scheduler.update_from_output(plan_n, {"r": 70}, num_accepted={"r": 1}, drafts={"r": [71, 72, 73, 74]})
    assert request.output_token_ids == [50, 51, 70]
    assert request.num_computed_tokens == 17 and request.num_pending_tokens == 5  # 12 + 5 in flight
    scheduler.update_from_output(plan_next, {"r": 80}, num_accepted={"r": 2}, drafts={"r": [81, 82, 83, 84]})
    assert request.output_token_ids == [50, 51, 70, 71, 72, 80]
    assert (request.num_computed_tokens, request.num_pending_tokens, request.num_inflight_verifies) == (15, 0, 0)
    assert scheduler.schedule().chunks[0].token_ids == (80, 81, 82, 83, 84)


def test_a_request_preempted_while_its_placeholder_drafts_are_verified_keeps_the_kept_ones():
    """Asynchronous scheduling: step N+1 verifies N's drafts as placeholders; the request is preempted before N+1's
    update. That update reads the kept drafts from the request (the runner knew them): none may be lost."""
    scheduler, request, kv = make()
    plan_n = scheduler.schedule()  # verifies 51..54 after token 50
    request.num_drafts_in_flight = 4
    plan_next = scheduler.schedule()  # verifies N's drafts, unknown yet
    scheduler.update_from_output(plan_n, {"r": 70}, num_accepted={"r": 1}, drafts={"r": [71, 72, 73, 74]})
    scheduler._preempt(request, type("P", (), {"preempted": []})())  # a later plan needs its pages
    assert request.spec_token_ids == [71, 72, 73, 74]  # still to be read by plan_next's update
    scheduler.update_from_output(plan_next, {"r": 80}, num_accepted={"r": 2}, drafts={"r": [81, 82, 83, 84]})
    assert request.output_token_ids == [50, 51, 70, 71, 72, 80]
    assert request.spec_token_ids == [] and request.num_inflight_verifies == 0  # not running: its drafts go
    assert request in scheduler.waiting and not kv.block_tables
