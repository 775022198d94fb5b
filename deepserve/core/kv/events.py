"""KV cache events for cache-aware routers: which blocks an engine's pages hold. `KVCacheManager` emits
`BlockStored` when it registers a block (computed, or placed from a lower tier) and `BlockRemoved` when a cached
page is evicted, with vLLM's fields (`vllm.distributed.kv_events`); `medium` names the tier (`GPU`: the pages).
Block hashes are the 32-byte chained sha256 the prefix cache keys pages by (vLLM's `ExternalBlockHash` is bytes
or int).

`KVEventsConfig` is vLLM's `--kv-events-config` (`{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": ""}`); the ZMQ publisher, which sends these as vLLM's msgpack
`KVEventBatch`, is `deepserve.plugins.cache.kv_events`. Plain Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


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
