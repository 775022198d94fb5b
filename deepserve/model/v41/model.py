"""DeepSeek-V4.1 (`deepseek_v41`, `DeepseekV41ForCausalLM`): blocks with shifted mHC, CSA2 attention, Engram,
MoE, the head, and the DSpark drafter (v41-architecture.md §2-§6).

`forward(ids, state)` runs a sequence's new tokens (a prefill, a later prompt chunk, a decode token) over its
caller-owned `V41SequenceState` and returns a `V41Output` (last or all-position logits, per-block outputs, the
DSpark taps). `forward(..., forced=...)` feeds each block a given input instead of the previous block's output
(the golden check's layer-forced protocol). `dspark_draft` drafts `dspark_block_size` tokens in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, DSparkAttention, Shared
from .config import V41Config
from .decode_rows import DecodeRows
from .engram import Engram, EngramHasher
from .moe import MoE
from .numerics import (GEMM_ROWS, QuantWeight, gemm, hc_collapse, hc_expand, hc_mixes, linear, per_row, rms_norm,
                       rope_tail, sparse_attention)
from .state import EngramStateSpec, V41SequenceState, contiguous_state, dspark_specs, layer_specs


class Block(nn.Module):
    """One layer: attention then MoE, each between an mHC collapse and expand. Shifted schedule: attention
    collapses with the `pre` the previous block's FFN site computed, the FFN with this attention site's `pre`,
    and this FFN site's `pre` goes to the next block."""

    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn = DSparkAttention(cfg, layer) if layer >= cfg.n_layers else Attention(cfg, layer)
        self.ffn = MoE(cfg, layer)
        self.engram = Engram(cfg, layer) if layer in cfg.engram_layer_ids and layer < cfg.n_layers else None
        self.attn_norm = self.ffn_norm = None
        self.hc_attn = self.hc_ffn = None  # (fn fp32 [(2+hc)*hc, hc*D], scale [3], base [(2+hc)*hc])

    def _mix(self, x, site, min_rows=1):
        c = self.cfg
        fn, scale, base = site
        return hc_mixes(x, fn, scale, base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, min_rows)

    def forward(self, x: torch.Tensor, pre: torch.Tensor, attend, min_rows: int = 1, apart: bool = False):
        """x [S, hc, D] bf16, pre [S, hc] fp32; `attend(h)` runs this block's attention on the normed input.
        Returns the streams and this FFN site's pre. `min_rows`: the plain GEMMs' row floor (`numerics.gemm`).
        `apart`: the rows are different sequences' decode tokens, each computed as its own call would
        (`numerics.per_row`)."""
        eps = self.cfg.norm_eps
        rows = per_row if apart else (lambda fn, *t: fn(*t))
        a_pre, a_post, a_comb = rows(lambda x: self._mix(x, self.hc_attn, min_rows), x)
        h = attend(rows(lambda x, p: rms_norm(hc_collapse(x, p), self.attn_norm, eps), x, pre))
        x = rows(hc_expand, h, x, a_post, a_comb)
        f_pre, f_post, f_comb = rows(lambda x: self._mix(x, self.hc_ffn, min_rows), x)
        h = self.ffn(rows(lambda x, p: rms_norm(hc_collapse(x, p), self.ffn_norm, eps), x, a_pre), min_rows, apart)
        return rows(hc_expand, h, x, f_post, f_comb), f_pre


@dataclass
class V41Output:
    logits: torch.Tensor  # fp32 [S, vocab] (all positions) or [vocab] (last)
    x_out: list[torch.Tensor] = field(default_factory=list)  # per block [S, hc, D] bf16
    pre_out: list[torch.Tensor] = field(default_factory=list)  # per block [S, hc] fp32
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [S, k] rows (offset removed)
    candidates: torch.Tensor | None = None  # candidate source's mask [S, T]
    engram_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # engram layer -> [S, cols]
    main_hidden: torch.Tensor | None = None  # DSpark taps: [S, len(targets) * D] bf16
    saved: dict[int, tuple] = field(default_factory=dict)  # forward_decode's kept rows: the state after each


@dataclass
class DSparkDraft:
    tokens: list[int]  # the drafts, one per block row
    logits: torch.Tensor  # fp32 [B, vocab] after the Markov bias
    confidence_logit: torch.Tensor  # fp32 [B]: the confidence head's linear output (no sigmoid)


class DeepseekV41ForCausalLM(nn.Module):
    main_state_owner = "layers"
    default_state_owners = ("layers",)

    def __init__(self, cfg, backend=None, tokenizer=None):
        super().__init__()
        self.cfg = cfg if isinstance(cfg, V41Config) else V41Config.from_hf(getattr(cfg, "raw", cfg))
        self.backend = backend
        c = self.cfg
        self.layers = nn.ModuleList([Block(c, j) for j in range(c.n_layers)])
        self.mtp = nn.ModuleList([Block(c, c.n_layers + i) for i in range(c.n_mtp_layers)])
        self.embed = self.norm = self.head = None  # bf16 [V, D]; norm weight; fp32 head [V, D]
        self.main_proj: QuantWeight | None = None
        self.main_norm = self.mtp_norm = None
        self.markov_embed = self.markov_head = self.confidence = None
        self.hasher = EngramHasher.build(c, tokenizer) if c.engram_layer_ids and tokenizer is not None else None

    # -- state owners ------------------------------------------------------------------------------------------
    def state_owners(self) -> dict[str, list]:
        """Per owner, one spec per layer: the backbone (`layers`: window-only, Full, Reuse, Reindex roles), the
        DSpark blocks (`dspark_layers`: rings of main keys) and Engram's token history (`engram`)."""
        owners = {"layers": layer_specs(self.cfg), "dspark_layers": dspark_specs(self.cfg)}
        if self.cfg.engram_layer_ids:
            owners["engram"] = [EngramStateSpec(history=self.cfg.engram_max_ngram_size - 1)]
        return owners

    def make_state(self, device=None) -> V41SequenceState:
        return contiguous_state(self.state_owners(), device or "cpu")

    def to_device(self, device) -> "DeepseekV41ForCausalLM":
        """Move every weight to `device` (in place; returns the model). The loader keeps most weights as plain
        attributes (tensors, `QuantWeight`s, `Expert`s) rather than parameters, so `nn.Module.to` alone would
        move only the buffers. On a CUDA device a `QuantWeight` takes its dense bf16 form (`QuantWeight.to`).
        Engram tables placed elsewhere (`load_v41(..., engram_device=)`) stay there."""
        device = torch.device(device)
        self.to(device)  # buffers (RoPE frequencies, unplaced Engram tables) and Engram's parameters
        for module in self.modules():
            for name, value in list(vars(module).items()):
                if not name.startswith("_") and name not in ("cfg", "backend", "hasher"):
                    setattr(module, name, _moved(value, device))
        return self

    # -- forward -----------------------------------------------------------------------------------------------
    def embed_streams(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed[ids].unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        pre = torch.zeros(ids.shape[0], self.cfg.hc_mult, dtype=torch.float32, device=h.device)
        pre[:, 0] = 1.0
        return h, pre

    @torch.inference_mode()
    def forward(self, ids, state: V41SequenceState, all_logits: bool = False, forced=None,
                prompt: bool = False, fresh_window: bool = False) -> V41Output:
        """Run `ids` (token ids at positions state.num_tokens..) through the backbone, updating `state`.
        forced: {block j: (x_in [S, hc, D], pre_in [S, hc])} inputs that replace block j-1's outputs.
        prompt: `ids` continue a prompt (a later chunk): its index sources read what one prefill of the whole
        prompt reads, where a decode step of one token reads the reference's stale index keys (`Shared`).
        fresh_window: the window starts at ids[0] (a bounded SWA replay, `replay.py`): no earlier key is read."""
        c = self.cfg
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        start = state.num_tokens
        if c.image_token_id >= 0 and bool((ids == c.image_token_id).any()):
            raise ValueError("image inputs need the V4.1 vision tower (the vision-encoder role), not built yet")
        out = V41Output(logits=torch.empty(0))
        row_ids = None
        if self.hasher is not None:
            row_ids, state.engram_history = self.hasher.hash(state.engram_history, ids)
        elif c.engram_layer_ids:
            raise RuntimeError("this V4.1 model has Engram layers but was built without a tokenizer")
        h, pre = self.embed_streams(ids.to(self.embed.device))
        # prefills and prompt chunks: row-count-invariant GEMMs (chunks compute one prefill); decode as the reference
        min_rows = GEMM_ROWS if start == 0 or prompt else 1
        shared, taps = Shared(prompt=prompt, min_rows=min_rows, fresh_window=fresh_window), []
        for j, blk in enumerate(self.layers):
            if forced is not None and j in forced:
                h, pre = forced[j]
            if blk.engram is not None:
                ids_j = row_ids[:, blk.engram.index]
                out.engram_ids[j] = ids_j
                h = blk.engram(h, ids_j)
            if j in c.dspark_target_layer_ids:
                taps.append(h.mean(dim=1))
            st = state.layers[j]
            h, pre = blk(h, pre, lambda x, blk=blk, st=st: blk.attn(x, start, st, state, shared), min_rows)
            if blk.attn.index_source and shared.topk is not None:
                out.topk[j] = torch.where(shared.topk >= 0, shared.topk - shared.topk_offset, -1)
            if blk.attn.candidate_source:
                out.candidates = shared.candidates
            out.x_out.append(h)
            out.pre_out.append(pre)
        state.num_tokens = start + ids.shape[0]
        hidden = rms_norm(hc_collapse(h, pre), self.norm, c.norm_eps)
        out.logits = self.logits(hidden if all_logits else hidden[-1:], min_rows)
        out.logits = out.logits if all_logits else out.logits[0]
        out.main_hidden = torch.cat(taps, dim=-1) if taps else None
        return out

    @torch.inference_mode()
    def forward_decode(self, ids, states: list[V41SequenceState], keep: Sequence[bool] | None = None) -> V41Output:
        """Decode steps of several sequences in one forward: `ids[i]` is a token of `states[i]` (each past its
        prompt). A sequence may have several rows, consecutive tokens in order (a verifying chunk [token,
        drafts...]): each row then computes the decode step after the rows before it (`decode_rows.py`). Each
        row gets the bits `forward([ids[i]], states[i])` gives it alone, one step after another: what is
        row-local and the same at any row count (the block-scaled GEMMs, the experts, the gathers) runs batched,
        the plain GEMMs and short activations per row (`numerics.per_row`), and each sequence's attention over
        its own state, row by row. Returns the logits [rows, vocab] and the DSpark taps; `keep[i]`: also the
        sequence's state after row i, in `V41SequenceState.save`'s form (`saved[i]`: what a verification rolls
        back to)."""
        c = self.cfg
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.shape[0] != len(states):
            raise ValueError(f"forward_decode got {ids.shape[0]} tokens for {len(states)} sequences")
        if min(st.num_tokens for st in states) == 0:
            raise ValueError("forward_decode runs decode steps; a sequence at position 0 needs forward (a prefill)")
        if c.image_token_id >= 0 and bool((ids == c.image_token_id).any()):
            raise ValueError("image inputs need the V4.1 vision tower (the vision-encoder role), not built yet")
        plan = DecodeRows(self.layers, states, keep)
        starts = plan.starts
        row_ids = None
        if self.hasher is not None:
            per_row_ids = []
            for i, st in enumerate(states):
                r, st.engram_history = self.hasher.hash(st.engram_history, ids[i : i + 1])
                per_row_ids.append(r)
                plan.hashed(i)
            row_ids = torch.cat(per_row_ids)
        elif c.engram_layer_ids:
            raise RuntimeError("this V4.1 model has Engram layers but was built without a tokenizer")
        h, pre = self.embed_streams(ids.to(self.embed.device))
        shared = [Shared() for _ in states]  # decode steps: the reference's stale index keys, one-row GEMMs
        taps = []
        for j, blk in enumerate(self.layers):
            if blk.engram is not None:
                h = per_row(blk.engram, h, row_ids[:, blk.engram.index])
            if j in c.dspark_target_layer_ids:
                taps.append(h.mean(dim=1))

            def attend(x, attn=blk.attn, j=j):
                qr, q_lin, kv_lin = attn.project_in(x, apart=True)
                rows = [(x[i : i + 1], qr[i : i + 1], q_lin[i : i + 1], kv_lin[i : i + 1], starts[i], st.layers[j],
                         plan.views[i], shared[i]) for i, st in enumerate(states)]
                outs = []
                for i, r in enumerate(rows):  # in order: a sequence's later row reads the layer after its earlier
                    if x.device.type == "cpu":  # each row's attention as its own decode step computes it
                        outs.append(attn.attend(*r))
                    else:  # gathered now, attended together below; a ring view copied before the next row's write
                        q, kv, cols, rot = attn.gather_keys(*r)
                        outs.append((q, kv.clone() if plan.repeated else kv, cols, rot))
                    plan.attended(i, j)
                if x.device.type == "cpu":
                    return attn.project_out(torch.cat(outs), apart=True)
                return attn.project_out(_attend_together(attn, outs))

            h, pre = blk(h, pre, attend, 1, apart=True)
        saved = plan.finish()
        hidden = per_row(lambda x, p: rms_norm(hc_collapse(x, p), self.norm, c.norm_eps), h, pre)
        return V41Output(logits=per_row(self.logits, hidden), main_hidden=torch.cat(taps, dim=-1) if taps else None,
                         saved=saved)

    def logits(self, hidden: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        return gemm(hidden.float(), self.head, min_rows)

    def final_logits(self, x_out: torch.Tensor, pre_out: torch.Tensor) -> torch.Tensor:
        """All-position logits from the last block's streams and pre (for a layer-forced comparison)."""
        return self.logits(rms_norm(hc_collapse(x_out, pre_out), self.norm, self.cfg.norm_eps))

    # -- DSpark ------------------------------------------------------------------------------------------------
    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(linear(main_hidden, self.main_proj), self.main_norm, self.cfg.norm_eps)

    @torch.inference_mode()
    def dspark_seed(self, main_hidden: torch.Tensor, state: V41SequenceState) -> None:
        """Write the main keys of `main_hidden`'s positions (from state.dspark_num_tokens on) into every DSpark
        block's ring. A prefill seeds the rings this way; `dspark_draft` seeds its own position."""
        mx = self.main_x(main_hidden)
        for blk, st in zip(self.mtp, state.dspark):
            blk.attn.seed(mx, state.dspark_num_tokens, st)
        state.dspark_num_tokens += main_hidden.shape[0]

    @torch.inference_mode()
    def dspark_draft(self, golden: int, main_hidden: torch.Tensor, state: V41SequenceState) -> DSparkDraft:
        """One DSpark pass after the main model emitted `golden` at position p + 1, where `main_hidden`
        [1, taps*D] is position p's: the block [golden, noise...] at p+1.. drafts one token per row (argmax
        after the Markov bias), with the confidence head's logits."""
        c = self.cfg
        p = state.dspark_num_tokens
        mx = self.main_x(main_hidden)
        block = torch.full((c.dspark_block_size,), c.dspark_noise_token_id, dtype=torch.long)
        block[0] = golden
        h, pre = self.embed_streams(block.to(self.embed.device))
        for blk, st in zip(self.mtp, state.dspark):
            h, pre = blk(h, pre, lambda x, blk=blk, st=st: blk.attn(x, p, st, mx))
        state.dspark_num_tokens = p + 1
        hidden = hc_collapse(h, pre)
        logits = self.logits(rms_norm(hidden, self.mtp_norm, c.norm_eps))
        toks, embeds = [golden], []
        for i in range(c.dspark_block_size):
            e = self.markov_embed[toks[-1]].unsqueeze(0)
            logits[i] += F.linear(e.float(), self.markov_head)[0]
            embeds.append(e[0])
            toks.append(int(logits[i].argmax()))
        conf = F.linear(torch.cat([hidden, torch.stack(embeds)], dim=-1).float(), self.confidence).squeeze(-1)
        return DSparkDraft(tokens=toks[1:], logits=logits, confidence_logit=conf)


def _moved(value, device):
    """`value` on `device` if it is a weight (a tensor, a `QuantWeight`, an `Expert`, or a list or tuple of
    them); anything else as it is."""
    from .moe import Expert

    if isinstance(value, (torch.Tensor, QuantWeight, Expert)):
        return value.to(device)
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (torch.Tensor, QuantWeight, Expert)) for v in value):
        return type(value)(v.to(device) for v in value)
    return value


def _attend_together(attn, gathered: list[tuple]) -> torch.Tensor:
    """Several sequences' decode queries in one `sparse_attention` (on a device; no bit-equality claim there):
    their keys side by side, each key list shifted to its sequence's keys (-1 kept)."""
    qs, kvs, cols, rots = zip(*gathered)
    base = 0
    shifted = []
    for kv, c in zip(kvs, cols):
        shifted.append(torch.where(c >= 0, c + base, -1))
        base += kv.shape[0]
    rot = torch.cat(rots)
    o = sparse_attention(torch.cat(qs), torch.cat(kvs), attn.sink, torch.cat(shifted), attn.hd**-0.5)
    return rope_tail(o, rot, attn.rd, inverse=True)
