"""KV cache events for cache-aware routers, in vLLM's wire shape (`vllm.distributed.kv_events`): a
`KVEventBatch(ts, events, data_parallel_rank)` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, msgpack
by msgspec (array-like structs, tagged events), published on a ZMQ PUB socket as the three frames
`[topic, sequence number (8 bytes, big-endian), payload]`; a router subscribes to every engine and so learns
which prefix blocks each one holds (SGLang publishes the same shape).

`medium` names the tier: `GPU` (the pages; `KVCacheManager` emits these), `CPU` (the host tier). Block hashes
are the 32-byte chained sha256 the prefix cache keys pages by (vLLM's `ExternalBlockHash` is bytes or int).

Configured as vLLM's `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": ""}'`. The publisher's thread owns the socket; the engine only appends to a
queue (`emit`), and the thread sends what gathered every `batch_seconds` as one batch. No replay socket yet: a
subscriber that misses a batch sees the gap in the sequence numbers.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

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


_FIELDS = ("enable_kv_cache_events", "publisher", "endpoint", "topic")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` fields that deepserve serves: `publisher` `zmq` (or `null`: none), `endpoint`
    (where the PUB socket binds), `topic` (the first frame of every message)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZMQ endpoint like 'tcp://*:5557', "
                             f"got {self.endpoint!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: Any) -> KVEventsConfig | None:
        """From None, a `KVEventsConfig`, a dict, or its JSON text (the CLI option)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON ({exc.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a dict like {{\"enable_kv_cache_events\": true}}, "
                             f"got {value!r}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"kv_events_config has unknown field(s) {unknown}; the fields are {list(_FIELDS)}")
        return cls(**value)


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

    def emit(self, event: KVCacheEvent) -> None:
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
                batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
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
