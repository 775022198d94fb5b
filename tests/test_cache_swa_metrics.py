"""`/metrics` counts the SWA host slots and SWA replays (docs/cache.md, "Metrics"): saves, restores, misses and
evictions of the slots, the pool's size, and the replays and their tokens by mode, each wired where the event
happens and read from the metrics text."""

from __future__ import annotations

import asyncio
import random
import types

from prometheus_client.parser import text_string_to_metric_families

from deepserve import LLM, SamplingParams
from deepserve.model.swa_replay import BOUNDED_LENGTH
from deepserve.server.metrics import ServerMetrics
from deepserve.server.state import ENGINE
from test_server import MODEL, chat_dir, make_app  # noqa: F401 - fixtures
from test_server_sessions import complete

P = 128


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a metrics text, by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def metrics(client) -> dict[tuple[str, tuple], float]:
    r = await client.get("/metrics")
    assert r.status == 200
    return samples(await r.text())


async def saved_after(app, session: str, old) -> bool:
    """Wait for the session's slot to be saved anew (the save runs with the step after the one that finished
    the request)."""
    directory = app[ENGINE].engine.swa_slots.directory
    for _ in range(500):
        entry = directory.get(session)
        if entry is not None and entry is not old:
            return True
        await asyncio.sleep(0.01)
    return False


def swa(found: dict, name: str) -> float:
    return found[(f"deepserve_{name}", ())]


async def test_slot_saves_restores_misses_and_evictions_are_counted(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, engine={"swa_host_slots": 1}))
    slot_bytes = client.app[ENGINE].engine.swa_slots.pool.slot_bytes
    rng = random.Random(0)
    first = [rng.randrange(3, 250) for _ in range(150)]
    before = await metrics(client)
    assert swa(before, "swa_slot_saves_total") == 0 and swa(before, "swa_slots") == 1
    assert swa(before, "swa_slot_bytes") == slot_bytes and swa(before, "swa_slots_used") == 0

    await complete(client, first, "a", 6)  # no slot yet: a miss, then its state is saved
    assert await saved_after(client.app, "a", None)
    entry = client.app[ENGINE].engine.swa_slots.directory.get("a")
    found = await metrics(client)
    assert (swa(found, "swa_slot_misses_total"), swa(found, "swa_slot_saves_total"),
            swa(found, "swa_slot_restores_total"), swa(found, "swa_slots_used")) == (1, 1, 0, 1)

    second = first[: entry.location.num_tokens // P * P] + list(entry.tail) + [rng.randrange(3, 250) for _ in range(9)]
    out = await complete(client, second, "a", 2)  # the next turn restores its tail from the slot
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == entry.location.num_tokens
    assert await saved_after(client.app, "a", entry)  # the continued turn replaces the slot
    found = await metrics(client)
    assert swa(found, "swa_slot_restores_total") == 1 and swa(found, "swa_slot_misses_total") == 1

    other = [rng.randrange(3, 250) for _ in range(140)]
    await complete(client, other, "b", 3)  # one slot: session b's save takes a's
    assert await saved_after(client.app, "b", None)
    found = await metrics(client)
    assert swa(found, "swa_slot_evictions_total") == 1 and swa(found, "swa_slot_misses_total") == 2
    assert swa(found, "swa_slots_used") == 1 and swa(found, "swa_slot_corrupt_total") == 0


def test_swa_replays_and_their_tokens_are_counted_by_mode(tiny_dir, tmp_path):
    rng = random.Random(6)
    prompt = [rng.randrange(2, 512) for _ in range(2 * P + 20)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def engine():
        return LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, kv_store=f"dir://{tmp_path}",
                   kv_store_snapshots=False, swa_replay="bounded")

    def scrape(llm) -> dict:
        server = ServerMetrics()
        server.engine = types.SimpleNamespace(snapshot=llm.engine.snapshot, engine=llm.engine)
        return samples(server.render().decode())

    first = engine()
    first.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert first.engine.kv_tiers.flush(5.0)
    found = scrape(first)
    assert found[("deepserve_swa_replays_total", (("mode", "bounded"),))] == 0
    second = engine()  # a restart: its prefix comes from the store without its window snapshot
    second.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    found = scrape(second)
    assert found[("deepserve_swa_replays_total", (("mode", "bounded"),))] == 1
    assert found[("deepserve_swa_replay_tokens_total", (("mode", "bounded"),))] == BOUNDED_LENGTH
    without = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P)  # no replay, no slots: no series
    assert not [name for name, _ in scrape(without) if name.startswith("deepserve_swa")]
