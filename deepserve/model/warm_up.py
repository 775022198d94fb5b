"""The step warm-up: once at start-up, every kind of step the engine will meet runs through the real runner and
model on scratch sequences, so that the kernels those steps use are compiled, tuned and cached before the first
request, not inside it.

A Triton kernel compiles once per specialization: each int argument is specialized on == 1 and on divisibility by
16, and tile choices by step size pick constexpr variants (the MoE's rows per block by (token, expert) pairs,
sparse MQA's few-query splits, `gemv` for a few rows against cuBLAS); DeepGEMM JIT-compiles its grouped GEMM for
long steps; a CUDA device loads each kernel module on its first launch. The decode steps' CUDA graphs are
captured by `DecodeGraphs.warm_up`; this covers the rest: prompt chunks of every length class up to the step's
token budget (`chunk_lengths`), a chunk after a computed prefix (a sequence's second chunk) and one after a prefix
hit (a new sequence starting on shared pages), a mixed step (decode rows beside a prompt chunk), a decode step,
decode steps of each batch-size class that no CUDA graph takes (all of them where decode steps run eagerly), and
with a speculative proposer, verify steps (every sampling chunk drafts, every decode row verifies).

Scratch state only: the sequences live before any request, their pages come from the KV manager
and go back to it (never registered, so no prefix-cache entry), the runner frees their slots in a last empty
step, and the engine core (scheduler, metrics, cost model) is not involved. `ModelRunner.warm_up` calls this.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from deepserve.core.interfaces import ChunkInput, StepInput, StepOutput
from deepserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: the kinds of step a warm-up runs (`WarmUpReport.steps` counts them)
KINDS = ("prompt", "prefix", "prefix_hit", "mixed", "decode", "verify")

_GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def wanted(option: bool | None, device) -> bool:
    """Whether an engine warms up: `option` (the engine's `warm_up`) when given, else on every device but the
    CPU (whose reference ops compile nothing)."""
    if option is not None:
        return option
    import torch

    return torch.device(device).type != "cpu"


def chunk_lengths(max_tokens: int) -> list[int]:
    """Prompt-chunk lengths, at most `max_tokens`, that meet every kernel variant a step's size picks: 1 (an int
    argument equal to 1), 2 and 3 (a few rows: `gemv`, few-query attention), 4, 5, 8 and 9 (where the few-row
    kernels end: `gemv`'s 4 rows; the FP4 experts' block a pair, up to 16 pairs: 8 tokens at top-2, 5 at
    top-3), then at each power of two from 16
    that length and the one below it (divisible by 16 and not), and at the top the longest of each class. The
    MoE's (token, expert) pairs double from one power to the next, and its buckets (rows per block; the
    one-program alignment; DeepGEMM from 16,384 pairs) span at least twice as many pairs, so each bucket the
    budget reaches gets a length of both classes (tests/test_warm_up.py checks this against the NVIDIA kernels)."""
    lengths = {1, 2, 3, 4, 5, 8, 9, max_tokens, max_tokens - 1, max_tokens - max_tokens % 16}
    n = 16
    while n <= max_tokens:
        lengths |= {n - 1, n}
        n *= 2
    return sorted(n for n in lengths if 1 <= n <= max_tokens)


@dataclass(slots=True)
class WarmUpReport:
    """What a warm-up ran: steps by kind (`KINDS`), the prompt-chunk lengths of its `prompt` steps, and its wall
    time in seconds."""

    steps: Counter = field(default_factory=Counter)
    prompt_lengths: list[int] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(slots=True)
class _Seq:
    """A scratch sequence: its prompt, the leading pages it shares with another one (a prefix hit), how many
    tokens the runner has computed, and the token (and drafts) the last step gave it."""

    request_id: str
    prompt: list[int]
    shared: list[int] = field(default_factory=list)
    num_tokens: int = 0
    next_token: int | None = None
    drafts: list[int] = field(default_factory=list)


class _WarmUp:
    def __init__(self, runner, kv_manager, max_step_tokens: int, max_model_len: int, num_speculative_tokens: int,
                 report: WarmUpReport) -> None:
        self.runner, self.kv, self.k, self.report = runner, kv_manager, num_speculative_tokens, report
        self.page = kv_manager.block_size
        self.vocab = runner.model.cfg.vocab_size
        self.max_step_tokens = max_step_tokens
        # the decode steps no CUDA graph takes (every one where decode runs eagerly: enforce_eager, a proposer), by
        # batch size up to the slots
        graphs, most = runner.graphs, min(runner.num_free_slots, max_step_tokens // (1 + self.k))
        smallest = graphs.batch_buckets[-1] + 1 if graphs is not None else 1
        self.decode_sizes = [b for b in chunk_lengths(most) if b >= smallest] if most >= 1 else []
        # decode rows the scratch sequences still take after their prompt: the mixed step's, the decode steps'
        self.margin = (2 + len(self.decode_sizes)) * (1 + self.k) + 1
        # three sequences hold pages at once (the prefix's source, its hit, the mixed step's new one)
        self.room = min(max_model_len, kv_manager.num_free_blocks // 3 * self.page)
        self.cap = min(max_step_tokens, self.room - self.margin)
        self.seqs: list[_Seq] = []  # every sequence made: their pages go back at the end
        self.live: list[_Seq] = []  # the ones the runner holds
        self.to_free: list[str] = []  # dropped from the runner by the next step
        self._serial = 0

    def plan(self) -> list:
        """The steps, as calls, so that the progress bar knows how many there are."""
        if self.cap < 1:
            logger.info("warm-up skipped: no room for a scratch sequence (%d free pages, max_model_len %d)",
                        self.kv.num_free_blocks, self.room)
            return []
        steps = [lambda n=n: self.prompt(n) for n in chunk_lengths(self.cap)]
        P = self.page
        if P + 2 + self.margin <= self.room:  # a full page to hit, and a chunk after it
            after = min(self.cap, self.room - P - self.margin)
            source = self._new(P + after)
            bounds = list(range(0, P, self.cap)) + [P, P + after]
            steps += [lambda s=s, e=e: self.feed(source, e - s) for s, e in zip(bounds, bounds[1:])]
            steps.append(lambda: self.prefix_hit(source, max(after - 1, 1)))
        else:  # a short sequence kept for the decode rows
            steps.append(lambda: self.feed(self._new(1), 1))
        steps += [self.mixed, self.decode]
        if self.decode_sizes:
            steps.append(self.new_rows)
            steps += [lambda b=b: self.decode(b) for b in self.decode_sizes]
        return steps

    # -- the steps --------------------------------------------------------------------------------------------------
    def prompt(self, n: int) -> None:
        """A new sequence's whole prompt of `n` tokens in one chunk; the sequence is dropped after."""
        seq = self._new(n)
        self.feed(seq, n)
        self._drop(seq)
        self.kv.free(seq.request_id)  # (the runner drops its state before the next step computes anything)

    def feed(self, seq: _Seq, n: int) -> None:
        """The next `n` prompt tokens of `seq` as one step (sampling when they end its prompt)."""
        self._run([self._prompt_chunk(seq, n)], "prompt" if seq.num_tokens == len(seq.shared) * self.page
                  else "prefix")

    def prefix_hit(self, source: _Seq, n: int) -> None:
        """A new sequence whose first page is `source`'s (saved with its boundary snapshot), then `n` tokens."""
        self._make_room()
        seq = self._new(n, prefix=tuple(source.prompt[: self.page]))
        seq.shared = self.kv.block_tables[source.request_id][:1]
        seq.num_tokens = self.page
        self._run([self._prompt_chunk(seq, n)], "prefix_hit")

    def mixed(self) -> None:
        """Every live sequence's decode row beside a new sequence's prompt chunk filling the step's budget."""
        rows = [s for s in self.live if s.next_token is not None]
        if self.runner.num_free_slots + len(self.to_free) < 1:  # no slot for the new sequence
            if len(rows) < 2:
                return  # an engine of one sequence a step meets no mixed step
            self._drop(rows.pop(0))
        n = self.cap - sum(1 + len(s.drafts) for s in rows)
        if not rows or n < 1:
            return
        seq = self._new(n)
        self._run([self._decode_chunk(s) for s in rows] + [self._prompt_chunk(seq, n)], "mixed")

    def new_rows(self) -> None:
        """Sequences of one token, all in one step, so that the decode steps have `decode_sizes[-1]` rows (as many as
        the free slots and pages allow)."""
        pages = -(-(1 + self.margin) // self.page)  # what each one takes
        n = min(self.decode_sizes[-1] - len(self.live), self.runner.num_free_slots + len(self.to_free),
                self.kv.num_free_blocks // pages)
        if n > 0:
            self._run([self._prompt_chunk(self._new(1), 1) for _ in range(n)], "prompt")

    def decode(self, size: int | None = None) -> None:
        """A decode row (a verify row with drafts) of each live sequence, or of the first `size`, alone."""
        rows = [s for s in self.live if s.next_token is not None][:size]
        if rows:
            self._run([self._decode_chunk(s) for s in rows], "verify" if any(s.drafts for s in rows) else "decode")

    # -- chunks and bookkeeping -------------------------------------------------------------------------------------
    def _new(self, n: int, prefix: tuple[int, ...] = ()) -> _Seq:
        """A scratch sequence of `prefix` and `n` more tokens spread over the vocabulary (no request exists yet,
        and none will find its state: the ids are the warm-up's own)."""
        self._serial += 1
        seq = _Seq(f"warm-up-{self._serial}", list(prefix) + [2 + (7919 * (self._serial + i) + i * i) %
                                                             (self.vocab - 2) for i in range(n)])
        self.seqs.append(seq)
        return seq

    def _prompt_chunk(self, seq: _Seq, n: int) -> ChunkInput:
        start, end = seq.num_tokens, seq.num_tokens + n
        samples = end == len(seq.prompt)
        return self._chunk(seq, start, tuple(seq.prompt[start:end]), samples, 0,
                           None if samples else seq.prompt[end])

    def _decode_chunk(self, seq: _Seq) -> ChunkInput:
        return self._chunk(seq, seq.num_tokens, (seq.next_token, *seq.drafts), True, len(seq.drafts), None)

    def _chunk(self, seq: _Seq, start: int, token_ids: tuple[int, ...], samples: bool, num_drafts: int,
               next_token: int | None) -> ChunkInput:
        end = start + len(token_ids)
        if self.kv.allocate_slots(seq.request_id, end - len(seq.shared) * self.page) is None:
            raise RuntimeError(f"the warm-up ran out of KV pages ({self.kv.num_free_blocks} free)")
        table = tuple(seq.shared + self.kv.block_tables[seq.request_id])
        P = self.page
        snapshots = tuple((b, table[b // P - 1]) for b in range((start // P + 1) * P, end + 1, P))
        if seq not in self.live:
            self.live.append(seq)
        return ChunkInput(seq.request_id, start, token_ids, samples, table, _GREEDY, 0, snapshots=snapshots,
                          num_draft_tokens=num_drafts, next_token_id=next_token,
                          num_speculative_tokens=self.k if samples else 0)

    def _run(self, chunks: list[ChunkInput], kind: str) -> StepOutput:
        freed, self.to_free = tuple(self.to_free), []
        out = self.runner.execute(StepInput(tuple(chunks), freed)).resolve()
        self.report.steps[kind] += 1
        if kind == "prompt":
            self.report.prompt_lengths.append(len(chunks[0].token_ids))
        by_id = {s.request_id: s for s in self.seqs}
        for c in chunks:
            seq = by_id[c.request_id]
            kept = len(c.token_ids) - c.num_draft_tokens + out.num_accepted.get(c.request_id, 0)
            seq.num_tokens = c.start + kept
            if c.samples:
                seq.next_token = out.sampled[c.request_id]
                seq.drafts = list(out.draft_token_ids.get(c.request_id, ()))
        return out

    def _make_room(self) -> None:
        """A slot for a new sequence (an engine of one sequence: the oldest live one leaves the runner)."""
        while self.live and self.runner.num_free_slots + len(self.to_free) < 1:
            self._drop(self.live[0])

    def _drop(self, seq: _Seq) -> None:
        """The runner frees `seq` in the next step; its pages stay taken until `release` (a hit may share them)."""
        self.live.remove(seq)
        self.to_free.append(seq.request_id)

    def release(self) -> None:
        """Free every scratch sequence in the runner (the last taken first, so the slots go back in their order)
        and give back every page."""
        freed = tuple(self.to_free) + tuple(s.request_id for s in reversed(self.live))
        self.to_free, self.live = [], []
        if freed:
            self.runner.execute(StepInput((), freed))
        for seq in reversed(self.seqs):
            self.kv.free(seq.request_id)


def run_warm_up(runner, kv_manager, max_step_tokens: int, max_model_len: int, num_speculative_tokens: int = 0,
                progress: bool = True) -> WarmUpReport:
    """Run the warm-up's steps through `runner` (a `ModelRunner`) on scratch sequences whose pages come from
    `kv_manager`, prompt chunks up to `max_step_tokens` (the engine's `max_num_batched_tokens`), sequences up to
    `max_model_len`; with a proposer, `num_speculative_tokens` drafts a step. Shows a progress bar with
    `progress`. Every page and slot is free again when it returns (or raises)."""
    from tqdm.auto import tqdm

    report = WarmUpReport()
    began = time.perf_counter()
    warm = _WarmUp(runner, kv_manager, max_step_tokens, max_model_len, num_speculative_tokens, report)
    steps = warm.plan()
    try:
        for step in tqdm(steps, desc="warming up step kernels", unit="step", disable=not progress or not steps):
            step()
    finally:
        warm.release()
    report.seconds = time.perf_counter() - began
    if steps:
        logger.info("warm-up: %d steps (%s) in %.2f s", sum(report.steps.values()),
                    ", ".join(f"{report.steps[k]} {k}" for k in KINDS if report.steps[k]), report.seconds)
    return report
