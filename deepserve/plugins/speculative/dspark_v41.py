"""DSpark as the proposer of a V4.1 model (v41-architecture.md §6): after each step, one DSpark pass per drafting
sequence proposes up to `dspark_block_size` tokens at once over the block [golden, noise...], the Markov head
biasing each row by the token before it, and the confidence head gives each draft's acceptance estimate,
which DSpark's planner (`dspark.DSparkPlanner`) turns into how many drafts to verify.

The drafter's state is the DSpark blocks' rings of main keys (`V41SequenceState.dspark`): the keys of every
committed position, seeded from the backbone's taps (the residual means at `dspark_target_layer_ids`) that the
runner hands over as the step's streams. A draft after position p seeds p itself; rejected drafts never reach
the rings, so a rollback leaves them as they are.
"""

from __future__ import annotations

import torch

from deepserve.model.speculative import DraftChunk, Drafts, Proposer, RowSampling


class V41DSparkProposer(Proposer):
    state_owners = ("dspark_layers",)

    def __init__(self, model, num_speculative_tokens: int, planner=None, temperature: float = 1.0) -> None:
        """`temperature`: the confidence head's T in sigmoid(logit / T) (the reference reads it from its
        environment, default 1)."""
        cfg = model.cfg
        if not cfg.n_mtp_layers:
            raise ValueError("this V4.1 checkpoint has no DSpark blocks (num_nextn_predict_layers 0)")
        if not 1 <= num_speculative_tokens <= cfg.dspark_block_size:
            raise ValueError(f"num_speculative_tokens {num_speculative_tokens}: DSpark drafts 1 to "
                             f"{cfg.dspark_block_size} tokens a pass (dspark_block_size)")
        if not temperature > 0:
            raise ValueError(f"the confidence temperature must be positive, got {temperature}")
        self.model, self.num_speculative_tokens, self.planner = model, num_speculative_tokens, planner
        self.temperature = temperature
        self._pages = None

    def bind(self, pages) -> None:
        """The runner's paged states, whose page snapshots get the rings as they were at each boundary."""
        self._pages = pages

    @torch.inference_mode()
    def propose(self, streams: torch.Tensor, chunks: list[DraftChunk], sampling: RowSampling) -> Drafts | None:
        tokens, confidences = [], []
        for d in chunks:
            st = d.state
            if st.dspark_num_tokens != d.start:
                raise RuntimeError(f"DSpark rings hold {st.dspark_num_tokens} positions, the chunk starts at "
                                   f"{d.start}")
            taps = streams[d.stream_rows.start : d.stream_rows.stop]
            self._seed(taps if not d.num_drafts else taps[:-1], d)
            if d.num_drafts:
                draft = self.model.dspark_draft(d.next_token_ids[-1], taps[-1:], st)
                k = d.num_drafts
                tokens.append(draft.tokens[:k])
                confidences.append(torch.sigmoid(draft.confidence_logit[:k] / self.temperature))
                self._snapshot(d, d.start + d.num_committed)
        if not tokens:
            return None
        token_ids = torch.tensor(tokens, dtype=torch.long, device=streams.device)
        probs = None
        if not sampling.all_greedy:  # the drafts are argmaxes: each q is one-hot at its draft
            probs = torch.nn.functional.one_hot(token_ids, self.model.cfg.vocab_size).float()
        return Drafts(token_ids, probs, torch.stack(confidences).float())

    def _seed(self, taps: torch.Tensor, d: DraftChunk) -> None:
        """Seed `taps`' positions (from d.start on), stopping at each page boundary to save the rings there."""
        st, begin = d.state, 0
        for boundary in sorted(b for b, _ in d.snapshots if d.start < b <= d.start + taps.shape[0]):
            end = boundary - d.start
            if end > begin:
                self.model.dspark_seed(taps[begin:end], st)
            self._snapshot(d, boundary)
            begin = end
        if taps.shape[0] > begin:
            self.model.dspark_seed(taps[begin:], st)

    def _snapshot(self, d: DraftChunk, boundary: int) -> None:
        if self._pages is None or d.state.dspark_num_tokens != boundary:
            return
        for b, page in d.snapshots:
            if b == boundary:
                self._pages.snapshot_dspark(page, d.state)

