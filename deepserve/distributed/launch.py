"""Starting ranks: where they meet (ZMQ to the front, the torch.distributed rendezvous), which collective
backend they use, and the rank processes themselves.

Ports: the front binds its ZMQ ROUTER on `data_parallel_address:data_parallel_rpc_port`; the ranks'
`torch.distributed` rendezvous (TCP store) is on the same address at `data_parallel_rpc_port + 1`. On several
machines every node is given the same address (the front's node) and port, as vLLM's multi-node data-parallel
flags do.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from deepserve.core.config import EngineConfig
from deepserve.core.env import env_value

DIST_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, slots=True)
class RankContext:
    """What one rank process is told: its global rank, the world, where the front and the rendezvous are."""

    rank: int
    world_size: int
    front_endpoint: str  # tcp://host:port of the front's ROUTER
    dist_init_method: str  # tcp://host:port of the torch.distributed store
    dist_backend: str
    timeout: float  # seconds a collective or a silent peer may take before the rank gives up
    local_index: int = 0  # this rank among its machine's: its GPU under NCCL


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host`, whose successor is free too (the rendezvous uses port + 1)."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no two consecutive free ports on {host}")


def dist_backend(device: str | None) -> str:
    """NCCL on GPUs, gloo on CPUs; `DEEPSERVE_DIST_BACKEND` overrides (NCCL without a GPU is refused)."""
    import torch

    chosen = (env_value("DEEPSERVE_DIST_BACKEND") or "").strip().lower()
    if chosen and chosen not in DIST_BACKENDS:
        raise ValueError(f"DEEPSERVE_DIST_BACKEND must be one of {list(DIST_BACKENDS)}, got {chosen!r}")
    gpu = torch.cuda.is_available() and (device is None or not device.startswith("cpu"))
    if not chosen:
        chosen = "nccl" if gpu else "gloo"
    if chosen == "nccl" and not torch.cuda.is_available():
        raise ValueError("DEEPSERVE_DIST_BACKEND=nccl needs CUDA GPUs and none is visible; use gloo on CPUs")
    return chosen


def rank_contexts(config: EngineConfig, port: int) -> list[RankContext]:
    """The contexts of the ranks this machine starts (`data_parallel_size_local` from `data_parallel_start_rank`)."""
    addr = config.data_parallel_address
    backend = dist_backend(config.device)
    start = config.data_parallel_start_rank
    return [RankContext(rank, config.data_parallel_size, f"tcp://{addr}:{port}", f"tcp://{addr}:{port + 1}",
                        backend, config.data_parallel_timeout, rank - start)
            for rank in range(start, start + config.local_data_parallel_size)]


def torchrun_context(config: EngineConfig, environ=os.environ) -> RankContext | None:
    """This process's rank when `torchrun` started it (its RANK, WORLD_SIZE, LOCAL_RANK and the MASTER_ADDR /
    MASTER_PORT rendezvous), else None. The world must be `data_parallel_size`; the front is at
    `data_parallel_address:data_parallel_rpc_port`."""
    if not all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    rank, world, local = int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"])
    if world != config.data_parallel_size:
        raise ValueError(f"torchrun started a world of {world} processes but data_parallel_size is "
                         f"{config.data_parallel_size}: they must match")
    if config.data_parallel_rpc_port is None:
        raise ValueError("under torchrun the ranks need the front's --data-parallel-address and "
                         "--data-parallel-rpc-port")
    return RankContext(rank, world, f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}",
                       "env://", dist_backend(config.device), config.data_parallel_timeout, local)


def start_ranks(target: Callable[[EngineConfig, RankContext], None], config: EngineConfig,
                contexts: list[RankContext]) -> list[multiprocessing.Process]:
    """One spawned process per context, running `target(config, context)` (a module-level function)."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for context in contexts:
        proc = ctx.Process(target=target, args=(config, context), name=f"deepserve-rank-{context.rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def init_process_group(context: RankContext):
    """Join the ranks' group; returns it."""
    import torch.distributed as dist

    dist.init_process_group(context.dist_backend, init_method=context.dist_init_method, rank=context.rank,
                            world_size=context.world_size, timeout=timedelta(seconds=context.timeout))
    # (env:// under torchrun reads MASTER_ADDR / MASTER_PORT; rank and world are given explicitly either way)
    return dist.group.WORLD
