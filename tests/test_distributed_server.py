"""The HTTP server in front of two expert-parallel ranks (gloo, the embedded model, EPLB every 3 steps):
streaming equals one process, a client that disconnects aborts its request on its rank, `/metrics` shows each
rank and their sums and EPLB's imbalance, reassignments and moved slots, and the graceful shutdown lets a
stream finish and then stops every rank (one app: each start of two ranks costs ~10 s)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from deepserve import LLM, SamplingParams
from deepserve.core.env import default_model_dir
from deepserve.core.plugins import make_plugin_manager
from deepserve.server import ENGINE, ServerConfig, create_app

MODEL = str(default_model_dir())
OPTIONS = dict(max_num_seqs=4, kv_cache_bytes=2**24, block_size=128, max_model_len=512)


def make_app():
    config = ServerConfig(model=MODEL, served_model_name="tiny", default_thinking_mode=False,
                          engine_kwargs=dict(OPTIONS, data_parallel_size=2, enable_expert_parallel=True,
                                             enable_eplb=True, num_redundant_experts=2, eplb_window_size=2,
                                             eplb_step_interval=3))
    return create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False))


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise KeyError((name, labels))


async def until(condition, seconds: float = 60.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_streams_aborts_metrics_and_shutdown_across_ranks(aiohttp_client):
    client = await aiohttp_client(make_app())
    front = client.app[ENGINE].engine
    prompt = [5, 6, 7, 8, 9, 10, 11]
    want = LLM(**OPTIONS).generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    whole = await (await client.post("/v1/completions", json=body)).json()
    streamed = await (await client.post("/v1/completions", json={**body, "stream": True})).text()
    pieces = [json.loads(line[len("data: "):]) for line in streamed.split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert whole["choices"][0]["text"] == want.outputs[0].text
    assert "".join(p["choices"][0]["text"] for p in pieces) == want.outputs[0].text

    long = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 300, "ignore_eos": True, "stream": True}
    response = await client.post("/v1/completions", json=long)
    line = b""
    while not line.startswith(b"data:"):
        line = await response.content.readline()
    assert front.has_unfinished_requests()
    beside = await client.post("/v1/completions", json={**body, "max_tokens": 4})  # the least-loaded: the other rank
    assert beside.status == 200, await beside.text()
    response.close()  # the client goes away mid-stream: the rank holding the request aborts it
    assert await until(lambda: not front.has_unfinished_requests()
                       and all(s.num_requests_running == 0 for s in front.rank_snapshots))
    metrics = await (await client.get("/metrics")).text()
    assert 'deepserve_requests_finished_total{reason="abort"} 1.0' in metrics
    stats = front.rank_stats
    for name, field in (("kv_cache_pages_total", "num_kv_pages_total"), ("generation_tokens_total",
                                                                          "num_generation_tokens")):
        per_rank = [metric(metrics, f"deepserve_rank_{name}", rank=str(r)) for r in range(2)]
        assert per_rank == [getattr(s, field) for s in stats.snapshots]
        assert metric(metrics, f"deepserve_{name}") == sum(per_rank)
        vllm = "vllm:generation_tokens_total" if field == "num_generation_tokens" else None
        if vllm:  # vLLM's engines are labelled `engine`: one series per rank
            assert [metric(metrics, vllm, model_name="tiny", engine=str(r)) for r in range(2)] == per_rank
    assert sum(s.num_generation_tokens for s in stats.snapshots) >= 16
    assert min(s.num_generation_tokens for s in stats.snapshots) > 0  # the one beside the long one: rank 1
    # EPLB: reassignments every 3 steps moved slots; its latest imbalance per MoE site (every layer's and the MTP
    # block's) is at least 1
    rebalances = metric(metrics, "deepserve_eplb_rebalances_total")
    assert rebalances == stats.num_rebalances >= 2
    moved = [metric(metrics, "deepserve_rank_eplb_slots_moved_total", rank=str(r)) for r in range(2)]
    assert metric(metrics, "deepserve_eplb_slots_moved_total") == sum(moved) == sum(stats.num_slots_moved) > 0
    config = json.loads((Path(MODEL) / "config.json").read_text())
    sites = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    imbalance = [metric(metrics, "deepserve_eplb_imbalance", layer=str(site)) for site in range(sites)]
    assert all(x >= 1.0 for x in imbalance) and list(stats.expert_imbalance) == imbalance
    assert metric(metrics, "deepserve_eplb_imbalance_max") == max(imbalance)
    assert 0 < metric(metrics, "deepserve_eplb_balancedness") <= 1.0

    # the graceful shutdown (SIGTERM's path): a stream in flight finishes, then every rank process ends
    short = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 12, "ignore_eos": True, "stream": True}
    response = await client.post("/v1/completions", json=short)
    first = await response.content.readline()
    closing = asyncio.create_task(client.server.close())
    rest = (await response.read()).decode()
    await closing
    events = [line for line in (first.decode() + rest).split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert await until(lambda: all(not p.is_alive() for p in front.processes), 30)
