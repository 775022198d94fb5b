"""One data-parallel rank's loop: its own engine (scheduler, KV pages, requests), requests in from the front over
ZMQ, outputs back, and, under expert parallelism, steps taken together with the other ranks.

Each iteration under expert parallelism:
1. take the front's messages (add, abort, shutdown) without waiting, or waiting up to `idle_poll` when the
   last iteration found every rank idle;
2. one all-reduce (MAX) of [this rank has work, this rank was asked to stop]: every rank learns whether any
   has work, and they all stop in the same iteration;
3. if any has work, each steps its engine once. The engine's runner is wrapped in a `LockstepExecutor`, whose
   `execute` ends with the transport's `finish_step`; a rank whose engine launched nothing runs
   `finish_step` alone (its dummy step: it serves the others' experts and sends no rows);
4. with EPLB, every rank hands the step's expert counts to its balancer (`eplb.py`), which may reassign
   experts before the next step;
5. outputs and the counters go to the front.
Without expert parallelism the ranks share nothing, and each loop just serves its own engine.
The engine runs synchronously here (`async_scheduling` off): a step's forward, and so its exchanges, are over
when `step()` returns, so that no two threads ever issue collectives.

`serve(context, make_engine)` is a rank process's body after its start-up: it connects to the front, builds the
engine with `make_engine` (a `RankEngine` factory called in this process: `deepserve.build` builds one from a
model directory; a benchmark passes its own) and runs the loop. The one-engine process (`engine_process.py`)
runs the same body.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import zmq

from deepserve.core.interfaces import ModelExecutor, StepInput, StepOutput

from . import messages as m
from .launch import RankContext
from .transport import ExpertTransport

logger = logging.getLogger(__name__)

#: seconds an idle rank waits for the front between all-reduces
IDLE_POLL_SECONDS = 0.02


class LockstepExecutor(ModelExecutor):
    """The runner, ending every step with the transport's `finish_step` (see the module docstring)."""

    def __init__(self, inner: ModelExecutor, transport: ExpertTransport, balancer=None) -> None:
        """`balancer`: a `deepserve.distributed.eplb.RankBalancer` that the rank loop calls after every step."""
        self.inner, self.transport, self.balancer = inner, transport, balancer
        self.num_steps = 0

    def execute(self, step: StepInput) -> StepOutput:
        out = self.inner.execute(step)
        out.resolve()  # the step's exchanges are done once its samples are; then serve the others
        self.transport.finish_step()
        self.num_steps += 1
        return out

    @property
    def num_free_slots(self) -> int:
        return self.inner.num_free_slots

    def __getattr__(self, name):  # the runner's other members (stats, caches) stay reachable
        return getattr(self.inner, name)


@dataclass(frozen=True, slots=True)
class RankEngine:
    """What a rank's engine factory returns: the engine the loop steps (an `EngineCore`, or anything that answers
    its calls), what the front is told of it (`Ready`), and, under expert parallelism, the ranks' process
    `group` and the `lockstep` runner inside the engine (None otherwise). `device`: where the group's tensors
    live."""

    engine: Any
    max_model_len: int
    max_num_seqs: int
    weight_bytes: int = 0
    device: str = "cpu"
    group: Any = None
    lockstep: LockstepExecutor | None = None


def connect_to_front(context: RankContext) -> zmq.Socket:
    """A DEALER connected to the front's ROUTER, named after the rank. No output is ever dropped (no high-water
    mark); a send that cannot go out for the rank's timeout fails (the front is taken for gone)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank-{context.rank}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(context.timeout * 1000))
    sock.connect(context.front_endpoint)
    return sock


def serve(context: RankContext, make_engine: Callable[[], RankEngine]) -> None:
    """Connect to the front, build this process's engine (`make_engine()`), tell the front it is ready and run
    the rank loop until the front says stop (or the process that started this one is gone). A factory that
    raises is told to the front (`RankFailed`) before the error propagates."""
    sock = connect_to_front(context)
    try:
        try:
            built = make_engine()
        except Exception as exc:  # the loop reports its own failures; these happen before it
            sock.send(m.to_front_encoder.encode(m.RankFailed(context.rank, f"{type(exc).__name__}: {exc}")))
            raise
        ready = m.Ready(context.rank, built.max_model_len, built.max_num_seqs, built.weight_bytes,
                        m.snapshot_to_wire(built.engine.snapshot()))
        RankLoop(context.rank, built.engine, sock, built.group, built.lockstep, ready, parent_pid=os.getppid(),
                 device=built.device).run()
    finally:
        sock.close()


class RankLoop:
    """`engine`: this rank's `EngineCore`; `socket`: a ZMQ DEALER connected to the front; `group`: the
    ranks' process group and `lockstep` the wrapped runner, both None without expert parallelism."""

    def __init__(self, rank: int, engine, socket: zmq.Socket, group=None, lockstep: LockstepExecutor | None = None,
                 ready: m.Ready | None = None, parent_pid: int | None = None, device: str = "cpu") -> None:
        """`parent_pid`: the process that started this rank; the loop stops when it is gone (an orphaned rank
        would otherwise wait for a front that never comes back). `device`: where the group's tensors live (the
        GPU under NCCL)."""
        self.rank, self.engine, self.socket, self.group, self.lockstep = rank, engine, socket, group, lockstep
        self.ready, self.parent_pid, self.device = ready, parent_pid, device
        self.stop_requested = False
        self.deltas = m.OutputDeltas()

    def run(self) -> None:
        try:
            self.socket.send(m.to_front_encoder.encode(self.ready))
            busy = True
            while True:
                changed = self._take_messages(0 if busy else int(IDLE_POLL_SECONDS * 1000))
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.error("rank %d: the process that started it is gone; stopping", self.rank)
                    self.stop_requested = True
                has_work = self.engine.has_unfinished_requests()
                any_work, stop = self._agree(has_work)
                if stop:
                    break
                busy = any_work
                outputs = list(changed)
                if any_work:
                    outputs += self._step(has_work)
                if outputs or has_work:
                    self._send_outputs(outputs)  # the counters too, for the front's /metrics
        except Exception as exc:  # noqa: BLE001 - told to the front, which shuts every rank down
            logger.exception("rank %d failed", self.rank)
            try:
                self.socket.send(m.to_front_encoder.encode(m.RankFailed(
                    self.rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the front is gone too: nobody to tell
            raise
        finally:
            self.engine.shutdown()

    def _agree(self, has_work: bool) -> tuple[bool, bool]:
        if self.group is None:
            return has_work, self.stop_requested
        flags = torch.tensor([int(has_work), int(self.stop_requested)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        flags = flags.tolist()
        return bool(flags[0]), bool(flags[1])

    def _step(self, has_work: bool) -> list:
        if self.lockstep is None:
            return self.engine.step() if has_work else []
        before = self.lockstep.num_steps
        outputs = self.engine.step() if has_work else []
        if self.lockstep.num_steps == before:  # nothing launched here: the dummy step
            self.lockstep.transport.finish_step()
        if self.lockstep.balancer is not None:  # every rank, every step: the same counts, the same reassignment
            self.lockstep.balancer.after_step()
        return outputs

    def _take_messages(self, wait_ms: int) -> list:
        """Apply what the front sent; returns the outputs of aborts."""
        outputs = []
        while self.socket.poll(wait_ms):
            wait_ms = 0
            msg = m.to_rank_decoder.decode(self.socket.recv())
            if isinstance(msg, m.AddRequest):
                try:
                    # views: each step's outputs become their changes (`OutputDeltas`) before the next step
                    self.engine.add_request(msg.request_id, msg.prompt_token_ids, m.params_from_wire(msg.params),
                                            prompt=msg.prompt, cache_salt=msg.cache_salt, final_only=msg.final_only,
                                            views=True)
                except ValueError as exc:  # the front validated what it could; the rest ends the request here
                    logger.warning("rank %d refused request %s: %s", self.rank, msg.request_id, exc)
                    outputs.append(_refused(msg, str(exc)))
            elif isinstance(msg, m.Abort):
                outputs += self.engine.abort(msg.request_ids)
            elif isinstance(msg, m.Shutdown):
                self.stop_requested = True
        return outputs

    def _send_outputs(self, outputs: list) -> None:
        balancer = self.lockstep.balancer if self.lockstep is not None else None
        to_wire = self.deltas.to_wire
        self._send(m.StepOutputs(self.rank, [o if isinstance(o, m.WireOutput) else to_wire(o) for o in outputs],
                                 m.snapshot_to_wire(self.engine.snapshot()),
                                 balancer.num_moves if balancer is not None else 0,
                                 balancer.balancer.latest_imbalance() if balancer is not None else None,
                                 balancer.num_slots_moved if balancer is not None else 0))

    def _send(self, msg) -> None:
        """Blocks while the front is slow (no output is dropped); past the socket's send timeout (the group's
        timeout) the front is taken for gone and the rank fails."""
        try:
            self.socket.send(m.to_front_encoder.encode(msg))
        except zmq.Again as exc:
            raise RuntimeError(f"rank {self.rank} could not reach the front within its timeout") from exc


def _refused(msg: m.AddRequest, why: str) -> m.WireOutput:
    return m.WireOutput(msg.request_id, None, [m.WireCompletion(0, 0, "", 0, [], None, 0, None, "abort", why)], True, 0,
                        m.WireMetrics(time.time(), None, None, None, time.time()), 0, 0, 0)
