"""Data-parallel attention with expert-parallel MoE, on CPU with gloo: two rank processes behind the front, on
the embedded tiny model. Outputs (tokens and logprobs, greedy and seeded) equal one process's bit for bit,
with redundant experts, a shuffled placement and EPLB reassignments in the middle of a run, with prefix caching,
with speculative decoding and for a JSON-schema request; aborts reach the right rank; a killed rank ends in
`RankError` and no rank process is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepserve import LLM, SamplingParams
from deepserve.core.env import default_model_dir
from deepserve.distributed.front import DataParallelEngine, RankError
from deepserve.distributed.launch import free_port

OPTIONS = dict(max_num_seqs=4, kv_cache_bytes=2**24, block_size=128, max_model_len=512)
PREFIX = [(7 * i) % 4000 + 2 for i in range(200)]  # more than a page: the second use takes a prefix hit
PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], list(range(40, 90)), PREFIX + [3, 4], PREFIX + [9]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=6, logprobs=1)


def summary(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**OPTIONS)
    return {name: summary(llm.generate(PROMPTS, params, use_tqdm=False))
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.fixture(scope="module")
def ep2():
    llm = LLM(data_parallel_size=2, enable_expert_parallel=True, **OPTIONS)
    yield llm
    llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_two_ranks_give_one_process_outputs(ep2, reference, kind):
    assert isinstance(ep2.engine, DataParallelEngine)
    outputs = ep2.generate(PROMPTS, GREEDY if kind == "greedy" else SEEDED, use_tqdm=False)
    assert summary(outputs) == reference[kind]


def test_both_ranks_serve_and_prefix_hits_happen(ep2, reference):
    before = [s.num_steps for s in ep2.engine.rank_snapshots]
    outputs = ep2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert summary(outputs) == reference["greedy"]
    after = ep2.engine.rank_snapshots
    assert all(a.num_steps > b for a, b in zip(after, before))  # least-loaded spread the prompts over both
    assert sum(o.num_cached_tokens for o in outputs) > 0  # the shared prefix hit on whichever rank saw it again
    total = ep2.engine.snapshot()
    assert total.num_prefix_hits == sum(s.num_prefix_hits for s in after)
    assert total.num_kv_pages_total == sum(s.num_kv_pages_total for s in after)


def test_abort_reaches_the_rank_that_holds_the_request(ep2):
    engine = ep2.engine
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], long)
    engine.add_request("b", [8, 9, 10], SamplingParams(temperature=0, max_tokens=4))
    assert set(engine._owner.values()) == {0, 1}  # one request on each rank
    finished = {}
    deadline = time.monotonic() + 120
    engine.abort(["a"])
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert len(finished["a"].outputs[0].token_ids) < 400
    assert finished["b"].outputs[0].finish_reason == "length" and len(finished["b"].outputs[0].token_ids) == 4


def test_structured_outputs_in_lockstep_give_one_process_outputs(ep2):
    """A JSON-schema request compiles and masks on its rank while the ranks step together (expert parallelism)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"], "properties": {
        "n": {"type": "integer", "minimum": -99, "maximum": 99}, "ok": {"type": "boolean"}}}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema})
    prompts = PROMPTS[:3]
    outputs = ep2.generate(prompts, params, use_tqdm=False)
    assert summary(outputs) == summary(LLM(**OPTIONS).generate(prompts, params, use_tqdm=False))
    assert all(o.outputs[0].finish_reason == "stop" and set(json.loads(o.outputs[0].text)) == {"n", "ok"}
               for o in outputs)


def test_a_killed_rank_is_an_error_and_every_rank_stops():
    llm = LLM(data_parallel_size=2, enable_expert_parallel=True, data_parallel_timeout=30, **OPTIONS)
    engine = llm.engine
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    engine.step()
    victim = engine.processes[1]
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    with pytest.raises(RankError, match="rank"):
        while time.monotonic() < deadline:
            engine.step()
    assert all(not p.is_alive() for p in engine.processes)


def test_speculative_decoding_across_ranks_keeps_one_process_outputs():
    spec = dict(OPTIONS, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0, max_tokens=10)
    want = [o.outputs[0].token_ids for o in LLM(**spec).generate(PROMPTS[:3], params, use_tqdm=False)]
    llm = LLM(data_parallel_size=2, enable_expert_parallel=True, **spec)
    try:
        outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want
        assert llm.engine.snapshot().spec.num_verified_tokens > 0  # the MTP block's MoE ran through the ranks too
    finally:
        llm.engine.shutdown()


def test_replicas_a_shuffled_placement_and_eplb_reassignments_change_no_output(reference):
    cfg = json.loads((Path(default_model_dir()) / "config.json").read_text())
    sites = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)  # every decoder layer's and the MTP's
    table = [[3, 7, 0, 5, 1, 6, 2, 4, 7, 0]] * sites  # 10 slots: experts 7 and 0 twice, in no particular order
    llm = LLM(data_parallel_size=2, enable_expert_parallel=True, expert_placement=table, enable_eplb=True,
              num_redundant_experts=2, eplb_window_size=2, eplb_step_interval=3, **OPTIONS)  # EPLB every 3 steps
    try:
        assert summary(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference["greedy"]
        assert summary(llm.generate(PROMPTS, SEEDED, use_tqdm=False)) == reference["seeded"]
        moves = llm.engine.num_expert_moves
        assert moves[0] == moves[1] >= 2  # both ranks moved experts, together, more than once
        assert llm.engine.expert_imbalance is not None and all(x >= 1.0 for x in llm.engine.expert_imbalance)
    finally:
        llm.engine.shutdown()


def test_ranks_started_elsewhere_under_torchrun_serve_a_front_with_none_of_its_own(reference):
    """`deepserve serve --headless` under torchrun's environment (as `torchrun --nproc-per-node 2` sets it) on
    "another machine", and a front here with `data_parallel_size_local=0`."""
    port, master = free_port(), free_port()
    flags = ["--data-parallel-size", "2", "--enable-expert-parallel", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(port), "--max-num-seqs", "4", "--kv-cache-bytes", str(2**24),
             "--block-size", "128", "--max-model-len", "512"]
    ranks = [subprocess.Popen([sys.executable, "-m", "deepserve", "serve", str(default_model_dir()), "--headless",
                               *flags], env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
    try:
        llm = LLM(data_parallel_size=2, data_parallel_size_local=0, data_parallel_rpc_port=port,
                  enable_expert_parallel=True, **OPTIONS)
        assert llm.engine.processes == []  # none started here
        assert summary(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference["greedy"]
        llm.engine.shutdown()
        assert [r.wait(timeout=60) for r in ranks] == [0, 0]  # the front's shutdown ended them
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()


def test_a_rank_that_cannot_start_is_an_error_naming_why():
    with pytest.raises(RankError, match="expert_transport 'deep_ep' is not a registered transport"):
        LLM(data_parallel_size=2, enable_expert_parallel=True, expert_transport="deep_ep", **OPTIONS)
