"""The MTP proposer: V4's multi-token-prediction block chained k times, on the device, after every target step.

Per step, for every sequence the target model just advanced (prefill chunks too, so the drafter's window is
always current):
1. catch-up: one varlen MTP pass pairs the target's final streams at each kept position i with the token at
   i + 1 (V3 alignment, `DeepseekV4ForCausalLM.mtp_forward`); this commits the MTP block's window ring, which
   lives in the paged cache's slot and page snapshots like the main layers' (prefix hits restore it);
2. chain (drafting sequences only): draft 1 comes from the catch-up's last row; draft j + 1 from the block run
   again one position further on its own output streams and draft j. The chain's window writes are
   speculative: the overwritten rows are saved first and put back afterwards, and the MTP token count is
   reset, so the next step's catch-up starts from committed state.
Drafts of greedy requests are the argmax; sampled requests draw from q = the MTP distribution under their
own sampling parameters (counter-based, salted key), and q is kept for the rejection rule. With a confidence
head (DSpark), each draft also gets its acceptance probability.
"""

from __future__ import annotations

import torch

from deepserve.sampling import argmax_lowest
from deepserve.model.batch import ForwardBatch, SeqChunk, make_batch
from deepserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from deepserve.model.speculative import DraftChunk, Drafts, Proposer, RowSampling
from deepserve.model.verify import DRAFT_SALT, target_probs


class MTPProposer(Proposer):
    state_owners = ("mtp_layers",)  # the MTP blocks' window rings
    def __init__(self, model: DeepseekV4ForCausalLM, num_speculative_tokens: int, confidence_head=None,
                 planner=None, with_confidences: bool = False) -> None:
        if not model.mtp:
            raise ValueError("speculative method 'mtp' needs an MTP block, and this checkpoint has none "
                             "(num_nextn_predict_layers = 0)")
        window = model.cfg.sliding_window
        if num_speculative_tokens + 1 > window:
            raise ValueError(f"num_speculative_tokens must be below the sliding window ({window}), "
                             f"got {num_speculative_tokens}")
        self.model, self.num_speculative_tokens = model, num_speculative_tokens
        self.head, self.planner, self.with_confidences = confidence_head, planner, with_confidences
        self.depth = len(model.mtp) - 1  # the last block: V4 ships one, chained for every draft
        self.chain_graphs = None  # `deepserve.model.draft_graphs.DraftChainGraphs`, once `capture_graphs` made it

    def capture_graphs(self, cache, max_batch: int, batch_sizes=None, capture: bool | None = None) -> int:
        """Run drafts 2..k of greedy steps from CUDA graphs over `cache`'s MTP pools (`draft_graphs`), every
        batch bucket made now; returns how many. Nothing to capture for k = 1 (draft 1 is the catch-up's)."""
        from deepserve.model.draft_graphs import DraftChainGraphs

        if self.num_speculative_tokens < 2:
            return 0
        self.chain_graphs = DraftChainGraphs(self, cache, max_batch, capture=capture, batch_sizes=batch_sizes)
        return self.chain_graphs.warm_up()

    @torch.inference_mode()
    def propose(self, streams: torch.Tensor, chunks: list[DraftChunk], sampling: RowSampling) -> Drafts | None:
        device = streams.device
        drafting = [i for i, c in enumerate(chunks) if c.num_drafts]
        batch = make_batch([c.next_token_ids for c in chunks], [c.start for c in chunks], device,
                           logits_rows=[[c.num_committed - 1] if c.num_drafts else [] for c in chunks],
                           snapshots=[c.snapshots for c in chunks])
        rows = torch.tensor([r for c in chunks for r in c.stream_rows], device=device)
        states = [c.state for c in chunks]
        out = self.model.mtp_forward(self.depth, batch, states, streams[rows])
        if not drafting:
            return None
        k = self.num_speculative_tokens
        ends = torch.tensor([batch.chunks[i].offset + batch.chunks[i].length - 1 for i in drafting], device=device)
        lengths = [chunks[i].start + chunks[i].num_committed for i in drafting]  # L: the committed length
        positions = torch.tensor(lengths, device=device)
        d_states = [states[i] for i in drafting]
        prev, logits, hidden = out.streams[ends], out.logits, out.hidden
        graphs = self.chain_graphs
        if graphs is not None and graphs.supports(len(drafting), sampling.all_greedy):
            return self._graph_chain(graphs, d_states, lengths, prev, logits, hidden)
        saved = [[layer.window.save(p, p + k - 1) for layer in s.mtp_layers]
                 for s, p in zip(d_states, lengths)] if k > 1 else []
        sampled = not sampling.all_greedy  # q is needed only for sampled requests
        tokens, probs, confs = [], [], []
        for j in range(k):
            token, q = self._draw(logits, sampling, positions + 1 + j, sampled)
            tokens.append(token)
            probs.append(q)
            if self.with_confidences:
                confs.append(self._confidence(hidden, logits, j))
            if j == k - 1:
                break
            step = _single_token_batch(token, [p + j for p in lengths], device)
            nxt = self.model.mtp_forward(self.depth, step, d_states, prev)
            prev, logits, hidden = nxt.streams, nxt.logits, nxt.hidden
        for s, p, rings in zip(d_states, lengths, saved):  # the chain's window writes were speculative
            for layer, ring in zip(s.mtp_layers, rings):
                layer.window.undo(p, ring, p)
        for s, p in zip(d_states, lengths):
            s.mtp_num_tokens = p
        return Drafts(torch.stack(tokens, 1), torch.stack(probs, 1) if sampled else None,
                      torch.stack(confs, 1) if confs else None)

    def _graph_chain(self, graphs, d_states, lengths, prev, logits, hidden) -> Drafts:
        """Greedy drafts: draft 1 from the catch-up here, drafts 2..k (with their confidences) from the graphs,
        which leave the MTP rings as committed."""
        first = argmax_lowest(logits)
        rest, rest_confs = graphs.run(first, prev, lengths, [s.mtp_layers[self.depth].slot for s in d_states])
        tokens = torch.cat((first[:, None], rest), 1)
        confs = None
        if self.with_confidences:
            confs = torch.cat((self._confidence(hidden, logits, 0)[:, None].float(), rest_confs), 1)
        for s, p in zip(d_states, lengths):
            s.mtp_num_tokens = p
        return Drafts(tokens, None, confs)

    def _draw(self, logits: torch.Tensor, sampling: RowSampling, positions: torch.Tensor, sampled: bool):
        """Draft tokens for the token positions `positions`, and q, the distribution they were drawn from (None
        when every row is greedy)."""
        if not sampled:
            return argmax_lowest(logits), None
        backend = self.model.backend
        token = backend.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                               sampling.seeds ^ DRAFT_SALT, positions)
        return token, target_probs(logits, sampling)

    def _confidence(self, hidden, logits, j):
        from deepserve.model.confidence import draft_confidence

        return draft_confidence(self.head, hidden, logits, j)


def _single_token_batch(token_ids: torch.Tensor, starts: list[int], device) -> ForwardBatch:
    n = token_ids.shape[0]
    return ForwardBatch(token_ids=token_ids, positions=torch.tensor(starts, device=device),
                        chunks=tuple(SeqChunk(offset=i, start=int(s), length=1) for i, s in enumerate(starts)),
                        logits_indices=torch.arange(n, device=device))
