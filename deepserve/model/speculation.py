"""Speculative decoding at the model runner's fixed points: a `Speculation` resolves a step's chunks before
the forward (the placeholders and relative starts that the previous step's drafts left), and after it verifies
every chunk's drafts (`deepserve.model.verify`: kept by the rejection rule, the state rolled back past the rest
through `SequenceUndo`) and lets the `Proposer` catch its drafter up and draft the next tokens, all before the
step returns. The step copies to the host twice: the kept counts and tokens (the drafter's batch layout depends
on them), then the drafts. The runner owns one when a proposer is configured and calls it at those two points;
which drafter runs (MTP, DSpark's, a plugin's) is the proposer's business alone.
"""

from __future__ import annotations

import torch

from deepserve.core.interfaces import DRAFT_PLACEHOLDER, PLACEHOLDER, ChunkInput, StepMasks, StepOutput

from .grammar_mask import mask_bias
from .speculative import DraftChunk, Proposer
from .verify import verify


class Speculation:
    """One runner's speculative decoding with `proposer`: the drafts each request has pending (their tokens and,
    for sampled requests, the draft distributions q), and the two calls a step makes."""

    def __init__(self, runner, proposer: Proposer) -> None:
        self.runner, self.proposer = runner, proposer
        self._draft_probs: dict[str, torch.Tensor] = {}  # q [k, V] of each request's pending drafts
        self._last: dict[str, tuple[int, list[int]]] = {}  # host copies: last sampled token and drafts

    @property
    def num_requests_held(self) -> int:
        """Requests with drafts or draft distributions held here (0 once every request is freed)."""
        return len(set(self._draft_probs) | set(self._last))

    def free(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        self._last.pop(request_id, None)

    def step(self, masks, forward, batch, chunks, last_rows, sampling, undo, out: StepOutput) -> None:
        """Verify the drafts (rolling back past rejected ones), then let the proposer draft the next ones."""
        grammar = self._verify_masks(masks, sampling, chunks, forward.logits.shape[-1], out) if sampling else None
        kept = self._verify(forward.logits, last_rows, chunks, sampling, grammar, undo, out) if sampling else {}
        self._propose(forward.streams, batch, chunks, kept, out)
        for c in chunks:
            if c.samples:
                self._last[c.request_id] = (out.sampled[c.request_id], out.draft_token_ids.get(c.request_id, []))

    def resolve(self, chunk: ChunkInput) -> ChunkInput:
        """Fill a chunk's placeholders (the token and drafts this runner's previous step made for the request) and
        give a relative chunk its real start: where the previous step's kept drafts left the sequence."""
        ids = chunk.token_ids
        if not chunk.relative and PLACEHOLDER not in ids and DRAFT_PLACEHOLDER not in ids:
            return chunk
        sampled, drafts = self._last[chunk.request_id]
        it = iter(drafts)
        ids = tuple(sampled if t == PLACEHOLDER else next(it) if t == DRAFT_PLACEHOLDER else t for t in ids)
        if not chunk.relative:
            return chunk._replace(token_ids=ids)
        start = self.runner._seqs[chunk.request_id].state.num_tokens
        P, table = self.runner.cache.page_size, chunk.block_table
        snaps = tuple((b, table[b // P - 1]) for b in range((start // P + 1) * P, start + len(ids) + 1, P)) \
            if self.runner.page_snapshots else ()
        return chunk._replace(start=start, token_ids=ids, snapshots=snaps)

    def _verify(self, logits, last_rows: list[int], chunks, sampling: list[int], grammar, undo, out: StepOutput):
        """Keep or reject the drafts of every sampling chunk, sample the token after them, roll back. Returns
        {chunk index: number of its tokens the state keeps}."""
        picked = [chunks[i] for i in sampling]
        num_drafts = [c.num_draft_tokens for c in picked]
        row_index = [r for i, k in zip(sampling, num_drafts) for r in range(last_rows[i] - k, last_rows[i] + 1)]
        rows = logits[torch.tensor(row_index, device=self.runner.device)]
        bonus = torch.tensor([sum(num_drafts[: n + 1]) + n for n in range(len(picked))], device=self.runner.device)
        rows[bonus] = self.runner._masked(rows[bonus], picked)  # min_tokens' blocked ids: such requests never draft
        if grammar is not None:  # grammar masks on every verified row of constrained requests
            mask_rows, bias = grammar
            rows.index_add_(0, torch.tensor(mask_rows, device=self.runner.device), bias.to(rows.dtype))
        sampling_rows = self.runner._row_sampling(picked).repeat_rows(num_drafts)
        positions = [c.start + len(c.token_ids) - k + j for c, k in zip(picked, num_drafts) for j in range(k + 1)]
        draft_ids = [t for c, k in zip(picked, num_drafts) for t in c.token_ids[len(c.token_ids) - k:] + (0,)]
        probs = exact = None
        if any(k and c.params.temperature > 0 and not c.exact_drafts for c, k in zip(picked, num_drafts)):
            probs = torch.zeros_like(rows)
            at = 0
            for c, k in zip(picked, num_drafts):
                if k and c.params.temperature > 0 and not c.exact_drafts:  # greedy and forced rows never read q
                    probs[at : at + k] = self._draft_probs[c.request_id][:k]
                at += k + 1
            exact = torch.tensor([c.exact_drafts for c, k in zip(picked, num_drafts) for _ in range(k + 1)],
                                 device=self.runner.device)
        device = self.runner.device
        num_kept, tokens = verify(self.runner.backend, rows, sampling_rows, torch.tensor(positions, device=device),
                                  num_drafts, torch.tensor(draft_ids, device=self.runner.device), probs,
                                  sampling_rows.all_greedy, exact)
        self.runner._prev = (tokens, {c.request_id: row for row, c in enumerate(picked)})
        kept_host, tokens_host = torch.stack((num_kept, tokens)).tolist()  # the step's first device-to-host copy
        kept = {}
        for i, c, k, a, token in zip(sampling, picked, num_drafts, kept_host, tokens_host):
            out.sampled[c.request_id] = token
            kept[i] = len(c.token_ids) - k + a
            if k:
                out.num_accepted[c.request_id] = a
            u = undo.get(i)  # (a verify graph's pass may cover more than the chunk: padding rows to roll back)
            if u is not None:
                if c.start + kept[i] < u.start + u.length:
                    u.rollback(c.start + kept[i])
                else:
                    u.commit()
        plain = [n for n, k in enumerate(num_drafts) if not k]  # logprobs: requests that ask for them never draft
        if plain:
            raw = logits[torch.tensor([last_rows[sampling[n]] for n in plain], device=self.runner.device)]
            self.runner._logprobs(raw, tokens[plain], [picked[n] for n in plain], out)
        return kept

    def _verify_masks(self, masks: StepMasks | None, sampling: list[int], chunks, vocab_size: int,
                      out: StepOutput):
        """(verify rows, their grammar mask bias) for constrained chunks, once the host has filled the bitmask:
        bitmask rows are consecutive per chunk (1 + drafts each), as the verify rows are."""
        bitmask = self.runner._wait_bitmask(masks, out)
        if bitmask is None:
            return None
        first, at = {}, 0
        for i in sampling:
            first[i] = at
            at += 1 + chunks[i].num_draft_tokens
        per_chunk = masks.rows_per_chunk or (1,) * len(masks.chunk_indices)
        rows = [first[i] + j for i, n in zip(masks.chunk_indices, per_chunk) for j in range(n)]
        return rows, mask_bias(bitmask, vocab_size, self.runner.device)

    def _propose(self, streams, batch, chunks, kept: dict[int, int], out: StepOutput) -> None:
        """Catch the drafter up on every chunk's kept tokens and draft for the chunks that ask."""
        todo = []
        for i, (c, seq_chunk) in enumerate(zip(chunks, batch.chunks)):
            n = kept.get(i, len(c.token_ids))
            last = out.sampled.get(c.request_id) if c.samples else c.next_token_id
            if last is None:
                raise RuntimeError(f"request {c.request_id}: the drafter needs the token after its chunk")
            end = c.start + n
            todo.append(DraftChunk(
                self.runner._seqs[c.request_id].state, c.start, n, range(seq_chunk.offset, seq_chunk.offset + n),
                list(c.token_ids[1:n]) + [last], c.num_speculative_tokens if c.samples else 0,
                tuple((b, p) for b, p in c.snapshots if b <= end)))
        drafting = [c for c, d in zip(chunks, todo) if d.num_drafts]
        for c in chunks:
            if c.samples:
                self._draft_probs.pop(c.request_id, None)  # drafts are good for one step only
        drafts = self.proposer.propose(streams, todo, self.runner._row_sampling(drafting))
        if drafts is None:
            return
        token_ids = drafts.token_ids.tolist()  # the step's second device-to-host copy
        confidences = drafts.confidences.tolist() if drafts.confidences is not None else None
        for d, c in enumerate(drafting):
            if drafts.probs is not None:
                self._draft_probs[c.request_id] = drafts.probs[d]
            out.draft_token_ids[c.request_id] = token_ids[d]
            if confidences is not None:
                out.draft_confidences[c.request_id] = confidences[d]
