"""The KV events publisher: `deepserve.core.kv.events`' events as vLLM's wire format, msgpack by msgspec
(array-like structs, tagged events) in a `KVEventBatch(ts, events, data_parallel_rank)`, on a ZMQ PUB socket as
the three frames `[topic, sequence number (8 bytes, big-endian), payload]`, which vLLM's and SGLang's router
subscribers decode. The publisher's thread owns the socket; the engine only appends to a queue (`emit`), and the
thread sends what gathered every `batch_seconds` as one batch. No replay socket yet: a subscriber that misses a
batch sees the gap in the sequence numbers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import msgspec

from deepserve.core.kv import events as core_events
from deepserve.core.kv.events import KVEventsConfig

logger = logging.getLogger(__name__)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the blocks one engine holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event) -> KVCacheEvent:
    """The msgspec struct of one `deepserve.core.kv.events` event."""
    if isinstance(event, core_events.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           event.lora_id, event.medium)
    if isinstance(event, core_events.BlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    if isinstance(event, core_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {event!r}")


class ZmqEventPublisher:
    """Sends the events `emit` gathers as `KVEventBatch`es on a ZMQ PUB socket, from a thread of its own."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None,
                 batch_seconds: float = 0.01) -> None:
        import zmq  # loads only when events are on

        self.config, self.data_parallel_rank, self.batch_seconds = config, data_parallel_rank, batch_seconds
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._encoder = msgspec.msgpack.Encoder()
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.bind(config.endpoint)  # here, so that a bad endpoint fails the engine's start
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_batches = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepserve-kv-events", daemon=True)
        self._thread.start()

    def emit(self, event) -> None:
        """Queue one event (any thread; never blocks)."""
        self._queue.put(event)

    def _run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            stopping = self._stopping.wait(self.batch_seconds)
            events = []
            while True:
                try:
                    events.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if events:
                batch = KVEventBatch(ts=time.time(), events=[to_wire(e) for e in events],
                                     data_parallel_rank=self.data_parallel_rank)
                try:
                    self._socket.send_multipart([topic, self.num_batches.to_bytes(8, "big"),
                                                 self._encoder.encode(batch)])
                except Exception as exc:  # noqa: BLE001 - events are advisory: a failed send loses one batch
                    logger.warning("publishing %d KV events failed: %s", len(events), exc)
                self.num_batches += 1
            if stopping:
                self._socket.close()
                return

    def close(self) -> None:
        """Send what is queued, then close the socket."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
