"""KV cache events in vLLM's shape: blocks registered and pages evicted (`deepserve.core.kv.events`), published
over ZMQ as msgpack `KVEventBatch`es (`deepserve.plugins.cache.kv_events`) that a router's subscriber decodes."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import torch
import zmq

from deepserve import LLM, SamplingParams
from deepserve.core.kv.events import BlockRemoved, BlockStored, KVEventsConfig
from deepserve.core.kv.manager import KVCacheManager
from deepserve.core.kv.prefix_hash import block_hashes
from deepserve.model.kv_cache import bytes_per_page
from deepserve.plugins.cache import kv_events as wire

P = 128


def test_the_manager_emits_stored_blocks_with_their_tokens_and_evicted_pages():
    events = []
    kv = KVCacheManager(num_blocks=3, block_size=P, emit=events.append)
    ids = list(range(2 * P + 5))
    kv.allocate_slots("a", len(ids))
    kv.cache_full_blocks("a", ids, len(ids), cache_salt="tenant")
    hashes = block_hashes(ids, P, "tenant")
    assert events == [BlockStored([hashes[0]], None, ids[:P], P, None, "GPU"),
                      BlockStored([hashes[1]], hashes[0], ids[P:2 * P], P, None, "GPU")]
    kv.free("a")
    kv.allocate_slots("b", 3 * P)  # takes every page: the cached ones are evicted, the tail first
    assert events[2:] == [BlockRemoved([hashes[1]], "GPU"), BlockRemoved([hashes[0]], "GPU")]


def subscribe(endpoint: str):
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def receive(socket, until, timeout: float = 20.0) -> list:
    """Decoded events, batch by batch, until `until(events)` holds (or `timeout` seconds pass)."""
    decoder = msgspec.msgpack.Decoder(wire.KVEventBatch)
    events, seqs = [], []
    deadline = time.monotonic() + timeout
    while not until(events) and time.monotonic() < deadline:
        if socket.poll(100):
            topic, seq, payload = socket.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            batch = decoder.decode(payload)
            assert topic == b"kv" and batch.ts > 0
            events += batch.events
    if seqs:
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no batch lost in between
    return events


def test_an_engine_publishes_its_blocks_for_routers(tiny_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    probe = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P)
    page = bytes_per_page(probe.model, P, torch.float32)
    llm = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, kv_cache_bytes=4 * page,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv"})
    socket = subscribe(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher (PUB drops what no subscriber asked for yet)
    rng = random.Random(0)
    prompt = [rng.randrange(2, 512) for _ in range(2 * P + 10)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    stored = receive(socket, lambda ev: sum(isinstance(e, wire.BlockStored) for e in ev) >= 2)
    hashes = block_hashes(prompt, P)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == \
        [([hashes[0]], None, prompt[:P]), ([hashes[1]], hashes[0], prompt[P:2 * P])]
    other = [rng.randrange(2, 512) for _ in range(3 * P + 10)]  # needs every page: the first prompt's go
    llm.generate([{"prompt_token_ids": other}], params, use_tqdm=False)
    later = receive(socket, lambda ev: any(isinstance(e, wire.BlockRemoved) for e in ev))
    removed = [h for e in later if isinstance(e, wire.BlockRemoved) for h in e.block_hashes]
    assert set(removed) <= set(hashes[:2]) and removed and all(e.medium == "GPU" for e in later)
    llm.parts.kv_events.close()
    socket.close()


@pytest.mark.parametrize("value, message", [
    ('{"enable_kv_cache_events": tru', "not valid JSON"),
    ({"enable_kv_cache_events": True, "replay": "x"}, "unknown field"),
    ({"enable_kv_cache_events": True, "publisher": "nats"}, "publisher"),
    ({"enable_kv_cache_events": True, "endpoint": "5557"}, "endpoint"),
])
def test_a_bad_events_config_names_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(value)
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}').enabled is False
