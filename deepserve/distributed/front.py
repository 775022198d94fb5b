"""The data-parallel front: the engine object `LLM`, `AsyncEngine` and the server drive when the model runs on
several ranks. It speaks `EngineCore`'s calls (`add_request`, `abort`, `step`, `has_unfinished_requests`,
`snapshot`, `shutdown`) and forwards them over ZMQ (a ROUTER socket; msgspec messages, `messages.py`) to the
rank processes, each with its own engine; a `Router` plugin picks each request's rank.

Structured outputs: a constrained request's `GrammarSpec` travels inside its `SamplingParams` to its rank, whose
engine compiles it on its own `GrammarCompiler` and masks as one process does. `grammars` is the front's own
compiler, built as a rank's is (same backends, timeout, errors): the server's compile-before-admit and
`LLM.generate` validate a spec on it, so an invalid one is refused here with one process's error before any
rank sees it (vLLM's front validates the same way), and the front never waits on a rank for a compile.

`step()` waits a little for the ranks' outputs and returns them. A rank that reports a failure, or whose
process ends, makes `step()` raise `RankError` naming it, after every rank has been shut down (asked, then
killed past `shutdown_timeout`), so a caller sees the error and no process is left behind.

The same front drives one engine in its own process (`engine_process.py`: a world of one rank).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zmq

from deepserve.core.engine import EngineSnapshot
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.outputs import RequestOutput
from deepserve.core.sampling_params import SamplingParams

from . import messages as m
from .router import RankLoad, Router

logger = logging.getLogger(__name__)

#: seconds `step()` waits for outputs while requests are unfinished
STEP_POLL_SECONDS = 0.05


def bind_router(endpoint: str) -> zmq.Socket:
    """The front's ROUTER, bound at `endpoint` (`tcp://host:port`, or `ipc://path` on one machine). No message may
    be dropped: unbounded queues (no high-water mark), and a send to a rank that is not connected raises instead
    of vanishing."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.bind(endpoint)
    return socket


class RankError(RuntimeError):
    """A rank failed or its process ended; every rank has been shut down."""


@dataclass(frozen=True, slots=True)
class RankStats:
    """What the front last heard from every rank, as one value: `DataParallelEngine.rank_stats` is replaced
    whole after each step that heard something, so a reader on another thread (the server's `/metrics`) sees
    one consistent set. `expert_imbalance`: EPLB's latest per-site imbalance (slowest rank over mean; None
    without EPLB or before its first counts); `num_expert_moves`: the reassignments each rank made (the ranks
    move together, so they agree); `num_slots_moved`: each rank's slots whose expert those moves changed."""

    snapshots: tuple[EngineSnapshot, ...]
    num_expert_moves: tuple[int, ...]
    num_slots_moved: tuple[int, ...]
    expert_imbalance: tuple[float, ...] | None

    @property
    def num_rebalances(self) -> int:
        return max(self.num_expert_moves, default=0)


@dataclass(frozen=True, slots=True)
class Capacity:
    """The front's stand-in for a scheduler where callers read capacity (the server's 429 queue)."""

    max_num_seqs: int


class DataParallelEngine:
    """`socket`: the front's bound ROUTER; `processes`: the rank processes this machine started (ranks started
    elsewhere, `--headless`, are only reached through the socket)."""

    def __init__(self, socket: zmq.Socket, world_size: int, router: Router, processes: Sequence = (), *,
                 vocab_size: int, start_timeout: float = 600.0, shutdown_timeout: float = 10.0,
                 grammars: GrammarCompiler | None = None) -> None:
        """`grammars`: the compiler that validates constrained requests here (see the module docstring); None:
        they are refused, as an `EngineCore` without one refuses them."""
        self.socket, self.world_size, self.router = socket, world_size, router
        self.processes = list(processes)
        self.vocab_size, self.shutdown_timeout = vocab_size, shutdown_timeout
        self.grammars = grammars
        self._owner: dict[str, int] = {}  # unfinished request -> its rank
        self._tokens: dict[str, int] = {}
        self._assigned = [0] * world_size
        self._assigned_tokens = [0] * world_size
        self._identity: dict[int, bytes] = {}
        self._outputs = m.OutputAccumulator()  # each unfinished request's prompt and outputs so far
        self._closed = False
        ready = self._wait_ready(start_timeout)
        self.max_model_len = min(r.max_model_len for r in ready)
        self.scheduler = Capacity(sum(r.max_num_seqs for r in ready))
        self.rank_snapshots: list[EngineSnapshot] = [m.snapshot_from_wire(r.snapshot) for r in ready]
        self.weight_bytes = [r.weight_bytes for r in ready]
        self.num_expert_moves = [0] * world_size  # EPLB reassignments each rank has made
        self.num_slots_moved = [0] * world_size  # each rank's slots whose expert a reassignment changed
        self.expert_imbalance: list[float] | None = None  # EPLB's latest per-site imbalance (the same on every rank)
        self.rank_stats = self._stats()

    # -- requests ------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None, final_only: bool = False,
                    views: bool = False) -> None:
        """As `EngineCore.add_request` (`views`: unfinished outputs hold `Prefix` views of the tokens and logprobs
        the front keeps, else copies)."""
        ids = list(prompt_token_ids)
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already running")
        if not ids:
            raise ValueError("prompt is empty: it needs at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}")
        spec = params.structured_outputs
        if spec is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need a grammar backend, and this engine has none "
                                 "(the model has no tokenizer.json, or no grammar backend plugin is installed)")
            self.grammars.backend_name(spec)  # an unknown backend raises here, as EngineCore.add_request does
        loads = [RankLoad(r, self._assigned[r], self._assigned_tokens[r], s.num_requests_running,
                          s.num_requests_waiting, s.num_kv_pages_used / max(s.num_kv_pages_total, 1))
                 for r, s in enumerate(self.rank_snapshots)]
        rank = self.router.choose(request_id, ids, loads)
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise RuntimeError(f"the router {type(self.router).__name__} chose rank {rank!r} of {self.world_size}")
        tokens = len(ids) + (params.max_tokens or 0)
        self._send(rank, m.AddRequest(request_id, ids, m.params_to_wire(params), prompt, cache_salt, final_only))
        self._outputs.add(request_id, prompt, ids, views)
        self._owner[request_id], self._tokens[request_id] = rank, tokens
        self._assigned[rank] += 1
        self._assigned_tokens[rank] += tokens

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Ask each request's rank to abort it; the aborted outputs come back through `step()`."""
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._owner:
                by_rank.setdefault(self._owner[request_id], []).append(request_id)
        for rank, ids in by_rank.items():
            self._send(rank, m.Abort(ids))
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    # -- stepping ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The outputs the ranks sent since the last call (waiting up to `STEP_POLL_SECONDS` for the first)."""
        self._check_processes()
        outputs: list[RequestOutput] = []
        heard = False
        wait_ms = int(STEP_POLL_SECONDS * 1000) if self._owner else 0
        while self.socket.poll(wait_ms):
            wait_ms = 0
            msg = self._recv()
            if isinstance(msg, m.StepOutputs):
                heard = True
                self.rank_snapshots[msg.rank] = m.snapshot_from_wire(msg.snapshot)
                self.num_expert_moves[msg.rank] = msg.num_expert_moves
                self.num_slots_moved[msg.rank] = msg.num_slots_moved
                if msg.imbalance is not None:
                    self.expert_imbalance = msg.imbalance
                from_wire = self._outputs.from_wire
                for wire in msg.outputs:
                    out = from_wire(wire)
                    if out.finished and out.request_id in self._owner:
                        self._release(out.request_id)
                    outputs.append(out)
            elif isinstance(msg, m.RankFailed):
                self._fail(f"rank {msg.rank} failed: {msg.error}")
        if heard:
            self.rank_stats = self._stats()
        return outputs

    def snapshot(self) -> EngineSnapshot:
        """Every rank's counters, summed (`rank_snapshots` has them one by one)."""
        total = _summed(self.rank_snapshots)
        return dataclasses.replace(total, num_speculative_tokens=self.rank_snapshots[0].num_speculative_tokens)

    def shutdown(self) -> None:
        """Ask every rank to stop, wait up to `shutdown_timeout`, then kill what is left."""
        if self._closed:
            return
        self._closed = True
        if self.grammars is not None:
            self.grammars.shutdown()
        for rank in self._identity:
            try:
                self._send_raw(rank, m.Shutdown())
            except zmq.ZMQError:
                pass  # already gone
        deadline = time.monotonic() + self.shutdown_timeout
        for proc in self.processes:
            proc.join(max(deadline - time.monotonic(), 0))
        for proc in self.processes:
            if proc.is_alive():  # ranks ignore SIGTERM (see deepserve.build.serve_rank): kill
                logger.warning("rank process %s did not stop within %.0f s: killing it", proc.name,
                               self.shutdown_timeout)
                proc.kill()
                proc.join(5)
        self.socket.close(linger=0)

    # -- internals -----------------------------------------------------------------------------------------------
    def _stats(self) -> RankStats:
        imbalance = self.expert_imbalance
        return RankStats(tuple(self.rank_snapshots), tuple(self.num_expert_moves), tuple(self.num_slots_moved),
                         None if imbalance is None else tuple(imbalance))

    def _wait_ready(self, timeout: float) -> list[m.Ready]:
        ready: dict[int, m.Ready] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.world_size:
            self._check_processes()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(ready))
                self._fail(f"rank(s) {missing} did not start within {timeout:.0f} s")
            if self.socket.poll(100):
                msg = self._recv()
                if isinstance(msg, m.Ready):
                    ready[msg.rank] = msg
                elif isinstance(msg, m.RankFailed):
                    self._fail(f"rank {msg.rank} failed to start: {msg.error}")
        return [ready[r] for r in range(self.world_size)]

    def _recv(self):
        identity, payload = self.socket.recv_multipart()
        msg = m.to_front_decoder.decode(payload)
        if isinstance(msg, (m.Ready, m.RankFailed, m.StepOutputs)):
            if not 0 <= msg.rank < self.world_size:
                self._fail(f"a rank reported rank {msg.rank}, outside the world of {self.world_size}")
            self._identity.setdefault(msg.rank, identity)
        return msg

    def _send(self, rank: int, msg) -> None:
        try:
            self._send_raw(rank, msg)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the rank's connection is gone
            self._fail(f"rank {rank} is unreachable: {exc}")

    def _send_raw(self, rank: int, msg) -> None:
        self.socket.send_multipart([self._identity[rank], m.to_rank_encoder.encode(msg)])

    def _release(self, request_id: str) -> None:
        rank = self._owner.pop(request_id)
        self._assigned[rank] -= 1
        self._assigned_tokens[rank] -= self._tokens.pop(request_id)

    def _check_processes(self) -> None:
        for proc in self.processes:
            if proc.exitcode is not None and not self._closed:
                self._fail(f"process {proc.name} (pid {proc.pid}) ended with exit code {proc.exitcode}")

    def _fail(self, why: str):
        logger.error("data-parallel front: %s; shutting every rank down", why)
        self.shutdown()
        raise RankError(why)


@dataclass(frozen=True, slots=True)
class RemoteModel:
    """The model as the front knows it: its config (prompt checks read the vocabulary); the weights are on the
    ranks."""

    cfg: object


def _summed(values: list):
    """Counters added across ranks: numbers summed, lists by position, dicts by key, dataclasses by field;
    absent (None) on a rank counts as nothing."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, bool):
        return any(present)
    if isinstance(first, (int, float)):
        return sum(present)
    if isinstance(first, list):
        width = max(map(len, present))
        return [_summed([v[i] for v in present if i < len(v)]) for i in range(width)]
    if isinstance(first, dict):
        return {k: _summed([v.get(k) for v in present]) for k in dict.fromkeys(k for v in present for k in v)}
    if dataclasses.is_dataclass(first):
        return type(first)(**{f.name: _summed([getattr(v, f.name) for v in present])
                              for f in dataclasses.fields(first)})
    return first
