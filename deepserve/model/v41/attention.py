"""CSA2 attention of one V4.1 layer (v41-architecture.md §3): the window of FP8 keys, plus for ratio > 0 up to
`index_topk` rows of the shared compressed cache chosen by the nearest index source. Kv sources ("Full") also
compress (ratio 2: softmax-pooled pairs; ratio 1: one row a token) and project index keys from the latent;
"Reindex" layers score the source's keys with their own query inside the candidate source's blocks; "Reuse"
layers take the nearest index source's top-k. A forward takes any number of new tokens at any position: a
prefill from position 0, a prompt chunk after earlier chunks (the ring's keys, then the chunk's), a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import V41Config
from .numerics import (fp4_fake_quant, fp8_fake_quant, linear, per_row, rms_norm, rope_inv_freq, rope_table,
                       rope_tail, sparse_attention, topk_low_ties)
from .state import LayerState, V41SequenceState


@dataclass
class Shared:
    """What a forward hands down the stack: the current kv source's rows, the nearest index source's top-k
    (window offset included) and the candidate source's mask. `prompt`: the tokens are prompt tokens, whose
    index sources read the keys one prefill of the whole prompt would (their kv source's), also at a one-token
    chunk that closes no group; a decode step keeps the reference's stale keys there (docs/v41.md)."""

    prompt: bool = False
    min_rows: int = 1  # the plain GEMMs' row floor (`numerics.gemm`)
    # the window starts at this forward's first token (a bounded SWA replay, `replay.py`): keys before it unread
    fresh_window: bool = False

    rows: torch.Tensor | None = None
    topk: torch.Tensor | None = None
    topk_offset: int = 0  # where the compressed rows start in the keys the top-k indexes (after the window's)
    candidates: torch.Tensor | None = None


def window_columns(win: int, start: int, seqlen: int, device) -> torch.Tensor:
    """Per query, `win` window key columns: prefill lists its causal window over the chunk's rows (then -1 up
    to `win`, so that a query's list does not depend on the forward's length); a decode step lists the whole
    ring oldest first (-1 for slots not yet written)."""
    if start == 0:
        end = torch.arange(seqlen, device=device).unsqueeze(1)
        cols = (end - win + 1).clamp(0) + torch.arange(win, device=device)
        return torch.where(cols > end, -1, cols).int()
    oldest = start % win + 1
    cols = torch.cat([torch.arange(oldest, win, device=device), torch.arange(oldest, device=device)])
    return torch.where(cols > start, -1, cols).int().unsqueeze(0)


def chunk_window_columns(win: int, start: int, seqlen: int, device) -> torch.Tensor:
    """The window columns of a prompt chunk at `start` > 0, whose keys follow the ring's `win` rows: per query
    its window oldest first (the positions before the chunk in their ring slots), then -1 up to `win`, the
    list one prefill of the whole prompt gives that query."""
    q = torch.arange(start, start + seqlen, device=device).unsqueeze(1)
    first = (q - win + 1).clamp(0)
    pos = first + torch.arange(win, device=device)
    cols = torch.where(pos < start, pos % win, win + pos - start)
    return torch.where(pos > q, -1, cols).int()


def candidate_mask(scores: torch.Tensor, visible, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level selection: per query, keep the `topk_blocks` blocks of `block` positions
    with the best max score, the block of its newest visible position always kept, all -inf blocks dropped."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block), value=-torch.inf)
    best = padded.unflatten(-1, (-1, block)).amax(-1)
    n = best.shape[-1]
    newest = (visible - 1) // block
    best = best.masked_fill(torch.arange(n, device=scores.device) == newest, torch.inf)
    vals, idx = topk_low_ties(best, min(topk_blocks, n))
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, idx, vals > -torch.inf)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


class Attention(nn.Module):
    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.compress_ratios[layer]
        self.is_backbone = layer < cfg.n_layers
        self.kv_source = self.is_backbone and layer in cfg.kv_source_layers
        self.index_source = self.is_backbone and layer in cfg.index_source_layers
        self.candidate_source = layer == cfg.candidate_source_layer
        self.uses_candidates = 0 <= cfg.candidate_source_layer < layer and self.index_source
        self.owns_index_keys = self.kv_source and self.index_source
        self.heads, self.hd, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        if self.ratio:
            inv = rope_inv_freq(self.rd, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                                cfg.beta_fast, cfg.beta_slow)
        else:
            inv = rope_inv_freq(self.rd, cfg.rope_theta, 0, 1.0, cfg.beta_fast, cfg.beta_slow)
        self.register_buffer("inv_freq", inv, persistent=False)
        # weights (set by the loader): QuantWeight for FP8, tensors for the bf16/fp32 ones
        self.wq_a = self.wq_b = self.wkv = self.wo_b = None
        self.wo_a: torch.Tensor | None = None  # bf16 [groups * o_lora, heads * hd / groups]
        self.q_norm = self.kv_norm = self.sink = None
        self.c_wkv = self.c_wgate = self.c_norm = None  # compressor (kv sources)
        self.i_wq_b = self.i_weights = self.i_wk = self.i_k_norm = None  # indexer

    # -- the window -----------------------------------------------------------------------------------------
    def _keys(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        return self._keys_from(linear(x, self.wkv), rot)

    def _keys_from(self, kv_lin: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        kv = rms_norm(kv_lin, self.kv_norm, self.cfg.norm_eps)
        return fp8_fake_quant(rope_tail(kv, rot, self.rd))

    def _window(self, kv: torch.Tensor, start: int, st: LayerState, step: bool) -> torch.Tensor:
        win = self.cfg.window_size
        s = kv.shape[0]
        if not step:
            keys = kv if start == 0 else torch.cat([st.ring, kv])  # a later chunk reads the ring before it
            tail = kv[-win:]
            slots = torch.arange(start + s - tail.shape[0], start + s, device=kv.device) % win
            st.ring[slots] = tail
            return keys
        st.ring[start % win] = kv[0]
        return st.ring

    def forward(self, x: torch.Tensor, start: int, st: LayerState, seq: V41SequenceState, shared: Shared):
        """x [S, D] bf16 (attn-normed) at positions start.. -> [S, D] bf16."""
        return self.project_out(self.attend(x, *self.project_in(x), start, st, seq, shared))

    def project_in(self, x: torch.Tensor, apart: bool = False):
        """The projections that do not depend on position or state: (q latent normed [S, q_lora], its query
        projection [S, heads * hd], the window key projection [S, hd]). `apart`: the rows are different
        sequences' decode tokens (`numerics.per_row` keeps each row's bits those of its own call)."""
        eps = self.cfg.norm_eps
        qa = linear(x, self.wq_a)  # block-scaled: a row's result does not depend on the rows beside it
        qr = per_row(lambda a: rms_norm(a, self.q_norm, eps), qa) if apart else rms_norm(qa, self.q_norm, eps)
        return qr, linear(qr, self.wq_b), linear(x, self.wkv)

    def attend(self, x, qr, q_lin, kv_lin, start: int, st: LayerState, seq: V41SequenceState, shared: Shared):
        """One sequence's attention over its state from `project_in`'s outputs; [S, heads, hd] before the
        output projection (RoPE undone)."""
        q, kv, cols, rot = self.gather_keys(x, qr, q_lin, kv_lin, start, st, seq, shared)
        return rope_tail(sparse_attention(q, kv, self.sink, cols, self.hd**-0.5), rot, self.rd, inverse=True)

    def gather_keys(self, x, qr, q_lin, kv_lin, start: int, st: LayerState, seq: V41SequenceState,
                    shared: Shared):
        """`attend` up to the attention itself: the state updated with the new tokens, and (queries [S, heads,
        hd] with RoPE, the keys they may read [N, hd], each query's key list [S, T] into them, the rotations)."""
        s = x.shape[0]
        rot = rope_table(self.inv_freq, torch.arange(start, start + s))
        q = rope_tail(q_lin.unflatten(-1, (self.heads, self.hd)), rot, self.rd)
        step = start > 0 and s == 1 and not shared.prompt  # a decode step: the ring alone, as the reference
        kv = self._window(self._keys_from(kv_lin, rot), start, st, step)
        win = self.cfg.window_size
        if shared.fresh_window and start > 0 and not step:  # the chunk's own causal window, after the ring's rows
            cols = window_columns(win, 0, s, x.device)
            cols = torch.where(cols >= 0, cols + win, -1)
        else:
            columns = window_columns if start == 0 or step else chunk_window_columns
            cols = columns(win, start, s, x.device).expand(s, -1)
        if self.ratio:
            rows, picks = self._compressed(x, qr, start, st, seq, shared, offset=kv.shape[0])
            kv = torch.cat([kv, rows])
            # every query lists `index_topk` picks (-1 past the rows it sees), whatever the forward's length
            pad = picks.new_full((s, self.cfg.index_topk - picks.shape[-1]), -1)
            cols = torch.cat([cols, picks, pad], dim=-1)
        return q, kv, cols, rot

    def project_out(self, o: torch.Tensor, apart: bool = False) -> torch.Tensor:
        g = self.cfg.o_groups
        wo_a = self.wo_a.view(g, self.cfg.o_lora_rank, -1)

        def grouped(o):  # a plain bf16 GEMM per group: per row when the rows are apart (`per_row`)
            return torch.einsum("bsgd,grd->bsgr", o.reshape(1, o.shape[0], g, -1), wo_a)[0].flatten(1)

        return linear(per_row(grouped, o) if apart else grouped(o), self.wo_b)

    # -- compressed rows and their selection ---------------------------------------------------------------
    def _group_rot(self, start: int, n_new: int) -> torch.Tensor:
        """Rotations of new compressed rows: row w stands for its group's first token, position w * ratio; the
        rows before position `start` are start // ratio."""
        r = self.ratio
        return rope_table(self.inv_freq, (start // r + torch.arange(n_new)) * r)

    def _compress(self, x: torch.Tensor, start: int, st: LayerState, shared: Shared) -> torch.Tensor | None:
        """The new latents before RoPE (None while the group is open)."""
        r, eps = self.ratio, self.cfg.norm_eps
        if r == 1:
            return rms_norm(linear(x, self.c_wkv), self.c_norm, eps)
        xf = x.float()
        kv, score = linear(xf, self.c_wkv, shared.min_rows), linear(xf, self.c_wgate, shared.min_rows)
        if start == 0 or x.shape[0] > 1 or shared.prompt:
            held = start % r  # a later chunk completes the group the tokens before it left open
            if held:
                kv, score = torch.cat([st.kv_open[:held], kv]), torch.cat([st.score_open[:held], score])
            n = kv.shape[0]
            rem = n % r
            cut = n - rem
            if rem:
                st.kv_open[:rem], st.score_open[:rem] = kv[cut:], score[cut:]
            if n < r:
                return None
            kv, score = kv[:cut].unflatten(0, (-1, r)), score[:cut].unflatten(0, (-1, r))
            pooled = (kv * score.softmax(dim=1)).sum(dim=1)
        else:
            slot = start % r
            st.kv_open[slot], st.score_open[slot] = kv[0], score[0]
            if (start + 1) % r:
                return None
            pooled = (st.kv_open * st.score_open.softmax(dim=0)).sum(dim=0, keepdim=True)
        return rms_norm(pooled.to(x.dtype), self.c_norm, eps)

    def _compressed(self, x, qr, start, st, seq, shared, offset):
        s = x.shape[0]
        end = start + s
        visible_rows = end // self.ratio
        latent = self._compress(x, start, st, shared) if self.kv_source else None
        if self.index_source:
            if visible_rows == 0:
                picks = torch.empty(s, 0, dtype=torch.int32, device=x.device)
            else:
                picks = self._index(x, qr, latent, start, st, seq, shared, offset)
            shared.topk, shared.topk_offset = picks, offset
        picks = shared.topk
        if latent is not None:
            latent = fp4_fake_quant(rope_tail(latent, self._group_rot(start, latent.shape[0]), self.rd), 16, True)
            st.append_rows(latent)
        if self.kv_source:
            shared.rows = st.rows
        return shared.rows[:visible_rows], picks

    def _index(self, x, qr, latent, start, st, seq, shared, offset):
        cfg, r = self.cfg, self.ratio
        s = x.shape[0]
        end = start + s
        if self.owns_index_keys and (latent is not None or shared.prompt):
            if latent is not None:
                k = rms_norm(linear(latent, self.i_wk), self.i_k_norm, cfg.norm_eps)
                k = fp4_fake_quant(rope_tail(k, self._group_rot(start, latent.shape[0]), self.rd), 32, False)
                st.append_index_keys(k)
            seq.index_key_publisher = self.layer
        keys = self._published_keys(seq)[: end // r]
        rot = rope_table(self.inv_freq, torch.arange(start, end))
        q = linear(qr, self.i_wq_b).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q = fp4_fake_quant(rope_tail(q, rot, self.rd), 32, False)
        w = linear(x, self.i_weights) * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        score = torch.einsum("bshd,btd->bsht", q.unsqueeze(0), keys.unsqueeze(0))
        score = (score.relu_() * w.unsqueeze(0).unsqueeze(-1)).sum(dim=2)[0]  # [S, T] bf16
        if s > 1:  # per query, the rows closed at or before it
            visible = (torch.arange(start + 1, end + 1, device=x.device) // r).unsqueeze(-1)
            score = score.masked_fill(torch.arange(end // r, device=x.device) >= visible, -torch.inf)
        else:
            visible = end // r
        if self.candidate_source:
            shared.candidates = candidate_mask(score, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        elif self.uses_candidates:
            score = score.masked_fill(~shared.candidates, -torch.inf)
        _, idx = topk_low_ties(score, min(cfg.index_topk, end // r))
        idx = idx.sort(dim=-1).values
        return torch.where(idx < visible, idx + offset, -1).int()

    def _published_keys(self, seq: V41SequenceState) -> torch.Tensor:
        if seq.index_key_publisher is None:
            raise RuntimeError(f"layer {self.layer}: no kv source has published index keys yet")
        return seq.layers[seq.index_key_publisher].index_keys


class DSparkAttention(Attention):
    """A DSpark block's attention: window-only over its ring of main keys (one per main position, projected
    from main_x) plus the draft block's own rows, bidirectional inside the block."""

    def seed(self, main_x: torch.Tensor, start: int, st: LayerState) -> None:
        """Write the main keys of positions start.. into the ring."""
        rot = rope_table(self.inv_freq, torch.arange(start, start + main_x.shape[0]))
        keys = self._keys(main_x, rot)
        win = self.cfg.window_size
        tail = keys[-win:]
        slots = torch.arange(start + keys.shape[0] - tail.shape[0], start + keys.shape[0]) % win
        st.ring[slots] = tail

    def forward(self, x: torch.Tensor, start: int, st: LayerState, main_x: torch.Tensor):
        """x [B, D] the draft block at positions start+1..start+B; main_x [1, D] is position `start`'s."""
        b, win = x.shape[0], self.cfg.window_size
        self.seed(main_x, start, st)
        rot = rope_table(self.inv_freq, torch.arange(start + 1, start + 1 + b))
        qr = rms_norm(linear(x, self.wq_a), self.q_norm, self.cfg.norm_eps)
        q = rope_tail(linear(qr, self.wq_b).unflatten(-1, (self.heads, self.hd)), rot, self.rd)
        kv = torch.cat([st.ring, self._keys(x, rot)])
        cols = torch.cat([torch.arange(min(win, start + 1)), win + torch.arange(b)]).int().expand(b, -1)
        o = sparse_attention(q, kv, self.sink, cols, self.hd**-0.5)
        return self.project_out(rope_tail(o, rot, self.rd, inverse=True))
