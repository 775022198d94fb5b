"""`mooncake://` block store against a real Mooncake Store master (started here with its HTTP metadata server on
free loopback ports, TCP transport). Skipped, saying why, where Mooncake's wheel does not load (pip install
mooncake-transfer-engine-non-cuda; it links libibverbs1) or its `mooncake_master` is not on PATH."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    import mooncake.store  # noqa: F401

    WHY = None
except ImportError as exc:
    WHY = f"Mooncake's client does not load: {exc}"
MASTER = shutil.which("mooncake_master") or shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
if WHY is None and MASTER is None:
    WHY = "no mooncake_master on PATH"
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))

from deepserve.core.kv.store import BlockKey  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A Mooncake master of our own, with its HTTP metadata server; yields the store URI."""
    rpc, meta, metrics = free_port(), free_port(), free_port()
    log = open(tmp_path_factory.mktemp("mooncake") / "master.log", "wb")
    proc = subprocess.Popen([MASTER, f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
                             f"-http_metadata_server_port={meta}", "-http_metadata_server_host=127.0.0.1",
                             f"-metrics_port={metrics}"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", meta), timeout=0.2).close()
            socket.create_connection(("127.0.0.1", rpc), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"mooncake_master did not start (exit {proc.poll()})")
            time.sleep(0.1)
    yield f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{meta}/metadata&segment_bytes={32 << 20}"
    proc.terminate()
    proc.wait(10)
    log.close()


def test_blocks_round_trip_through_a_mooncake_master(master):
    from deepserve.plugins.cache.plugin import make_mooncake_store

    async def go():
        store = make_mooncake_store(master)
        keys = [BlockKey("ns", h, pool) for h in (1, 2, 3) for pool in ("csa", "snapshot")]
        assert await store.put_many([(k, bytes([k.block_hash]) * 100) for k in keys[:4]]) == 4  # blocks 1, 2
        assert await store.longest_prefix("ns", [1, 2, 3], ["csa", "snapshot"]) == 2
        assert await store.longest_prefix("other", [1], ["csa"]) == 0
        buffers = [bytearray(100) for _ in keys]
        assert await store.get_many(keys, buffers) == [True] * 4 + [False] * 2
        assert bytes(buffers[2]) == bytes([2]) * 100
        assert await store.get_many(keys[:1], [bytearray(99)]) == [False]  # another layout's size: a miss
        assert await store.put_many([(keys[0], b"\x07" * 100)]) == 1  # written again: replaced
        assert await store.get_many(keys[:1], buffers[:1]) == [True] and bytes(buffers[0]) == b"\x07" * 100
        assert await store.evict(keys[:2]) == 2
        assert await store.longest_prefix("ns", [1, 2], ["csa"]) == 0
        await store.close()

    asyncio.run(go())


def test_a_second_engine_hits_what_the_first_wrote(master, tiny_dir):
    from deepserve import LLM, SamplingParams

    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(200)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def engine():
        return LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=128, kv_store=master)

    first = engine()
    cold = first.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    first.engine.kv_tiers.flush(5.0)
    second = engine()  # its own client; the blocks sit in the first one's segment
    warm = second.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 128
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    with pytest.raises(ValueError, match="Mooncake store URI"):
        from deepserve.plugins.cache.plugin import make_mooncake_store

        make_mooncake_store("mooncake:///no-host")
