"""The built-in block stores, contributed through `deepserve_register_cache_backends` by the URI scheme each
serves: `memory` (`memory_store.py`), `dir` (`dir_store.py`: a 3FS mount or any shared directory) and `redis` /
`rediss` (`redis_store.py`: a Redis server through redis-py's asyncio client) and `ec` (`ec_store.py`: K + M
erasure-coded fragments over child stores, which it opens through the registry) and `mooncake`
(`mooncake_store.py`: a Mooncake Store cluster, where its wheel is installed)."""

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


def make_mooncake_store(uri: str) -> BlockStore:
    try:
        from deepserve.plugins.cache.mooncake_store import MooncakeStore, parse_uri

        options = parse_uri(uri)  # a bad URI is named before the wheel is looked for
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"the mooncake:// store needs Mooncake's client: pip install mooncake-transfer-engine "
                         f"(or -non-cuda), and on Linux libibverbs1 ({exc})") from exc
    return MooncakeStore(**options)


@hookimpl
def deepserve_register_cache_backends(register: Register) -> None:
    register("memory", make_memory_store)
    register("dir", make_dir_store)
    register("redis", make_redis_store)
    register("rediss", make_redis_store)
    register("ec", make_ec_store)
    register("mooncake", make_mooncake_store)
