"""The built-in block stores, contributed through `deepserve_register_cache_backends` by the URI scheme each
serves: `memory` (`memory_store.py`), `dir` (`dir_store.py`: a 3FS mount or any shared directory) and `redis` /
`rediss` (`redis_store.py`: a Redis server through redis-py's asyncio client) and `ec` (`ec_store.py`: K + M
erasure-coded fragments over child stores, which it opens through the registry)."""

from __future__ import annotations

from deepserve.core.hookspecs import Register, hookimpl
from deepserve.core.kv.store import BlockStore


def make_memory_store(uri: str) -> BlockStore:
    from deepserve.plugins.cache.memory_store import MemoryStore

    return MemoryStore.from_uri(uri)


def make_dir_store(uri: str) -> BlockStore:
    from deepserve.plugins.cache.dir_store import DirStore

    return DirStore.from_uri(uri)


def make_redis_store(uri: str) -> BlockStore:
    from deepserve.plugins.cache.redis_store import RedisStore

    return RedisStore.from_uri(uri)


def make_ec_store(uri: str, registry) -> BlockStore:
    from deepserve.plugins.cache.ec_store import ErasureCodedStore

    return ErasureCodedStore.from_uri(uri, registry)


@hookimpl
def deepserve_register_cache_backends(register: Register) -> None:
    register("memory", make_memory_store)
    register("dir", make_dir_store)
    register("redis", make_redis_store)
    register("rediss", make_redis_store)
    register("ec", make_ec_store)
