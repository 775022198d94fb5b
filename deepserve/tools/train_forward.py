"""A batched training forward of deepserve's V4 model: B sequences of L tokens, all from position 0.

deepserve's inference forward is varlen and state-driven: every layer loops over the batch's sequences and
writes their caches, which costs thousands of small ops per sequence. Training needs none of that, so this module
re-expresses only the attention (window, CSA/HCA compression, lightning indexer) as [B, L] tensors with masks,
and reuses everything else as is: the model's own parameters and submodules (mHC sites, norms, MoE, MTP block,
final head) and the backend's ops. `check_against_inference` compares its logits (main model and MTP) with
deepserve's inference forward; `train_tiny` runs it before training and stops on a mismatch.

The same masks give the lightning indexer's training signal (DeepSeek-V3.2's DSA recipe): the KL from the
attention's mass on each selected compressed row to the indexer's softmax over those rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepserve.model.attention import Attention
from deepserve.model.compressor import _Pooler
from deepserve.model.decoder import DecoderLayer
from deepserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from deepserve.model.moe import MoE


@dataclass(slots=True)
class Pass:
    """What one batched pass needs besides the tensors: the shape, whether CSA attends to every compressed row
    (dense warm-up) or to the indexer's top-k, and where the indexer losses go."""

    B: int
    L: int
    positions: torch.Tensor  # [B * L]
    dense: bool = False
    indexer_losses: list[torch.Tensor] = field(default_factory=list)


def _pool(pooler: _Pooler, x: torch.Tensor, p: Pass) -> torch.Tensor:
    """Compressed rows [B, R, dim] of every closed block (`Compressor.emit` for a sequence from position 0)."""
    m, d, R = pooler.ratio, pooler.dim, p.L // pooler.ratio
    kv, gate = pooler.biased(pooler.kv_proj(x), pooler.gate_proj(x), p.positions)
    kv = kv.view(p.B, p.L, -1)[:, : R * m].reshape(p.B, R, m, -1)
    gate = gate.view(p.B, p.L, -1)[:, : R * m].reshape(p.B, R, m, -1)
    if pooler.overlap:  # entry w pools block w-1's Ca half and block w's Cb half
        prev_kv = torch.cat((torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]), dim=1)
        prev_gate = torch.cat((torch.full_like(gate[:, :1, :, :d], float("-inf")), gate[:, :-1, :, :d]), dim=1)
        kv = torch.cat((prev_kv, kv[..., d:]), dim=2)
        gate = torch.cat((prev_gate, gate[..., d:]), dim=2)
    pooled = pooler.backend.softmax_pool(kv.flatten(0, 1), gate.flatten(0, 1)).view(p.B, R, -1)  # [B, R, d]
    rows = pooler.backend.rms_norm(pooled, pooler.kv_norm.weight, pooler.eps)
    positions = (torch.arange(R, device=x.device) * m).repeat(p.B)
    return pooler.backend.apply_rope(rows.reshape(p.B * R, d), positions, pooler.inv_freq).view(p.B, R, d)


def _visible(L: int, R: int, m: int, device) -> torch.Tensor:
    """[L, R]: query t may use compressed row w iff w < (t + 1) // m."""
    return torch.arange(R, device=device)[None, :] < ((torch.arange(L, device=device) + 1) // m)[:, None]


def _indexer_selection(attn: Attention, x, qr, p: Pass, visible: torch.Tensor):
    """The indexer's scores [B, L, R] over visible rows and the selected set (its top-k, or all when dense)."""
    ix = attn.compressor.indexer
    keys = _pool(ix, x, p)  # [B, R, Di]
    q = ix.backend.apply_rope(ix.q_b_proj(qr).view(-1, ix.n_heads, ix.dim), p.positions, ix.inv_freq)
    q = q.view(p.B, p.L, ix.n_heads, ix.dim)
    w = (ix.scorer.weights_proj(x).float() * ix.weight_scale).view(p.B, p.L, ix.n_heads)
    dots = torch.relu(torch.einsum("blhd,brd->blhr", q.float(), keys.float()))
    scores = (dots * w[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))  # [B, L, R]
    if p.dense or ix.topk >= scores.shape[-1]:
        return scores, visible.expand_as(scores)
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[..., : ix.topk]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
    return scores, chosen & visible


def attention(attn: Attention, x: torch.Tensor, p: Pass) -> torch.Tensor:
    """`Attention.forward` for B sequences of L tokens from position 0 (no state)."""
    b, eps, T = attn.backend, attn.cfg.rms_norm_eps, x.shape[0]
    H, d, W, L = attn.num_heads, attn.head_dim, attn.window, p.L
    qr = b.rms_norm(attn.q_a_proj(x), attn.q_a_norm.weight, eps)
    q = b.rms_norm(attn.q_b_proj(qr).view(T, H, d), None, eps)
    q = b.apply_rope(q, p.positions, attn.inv_freq).view(p.B, L, H, d).float()
    kv = b.apply_rope(b.rms_norm(attn.kv_proj(x), attn.kv_norm.weight, eps), p.positions, attn.inv_freq)
    kv = kv.view(p.B, L, d).float()

    # window keys of query t: positions t-W+1 .. t, as a band [B, L, W, d] (position < 0 masked)
    kv_band = torch.nn.functional.pad(kv, (0, 0, W - 1, 0)).unfold(1, W, 1).transpose(2, 3)
    band_ok = (torch.arange(L, device=x.device)[:, None] - W + 1 + torch.arange(W, device=x.device)) >= 0
    logits = [torch.einsum("blhd,blwd->bhlw", q, kv_band).mul(attn.scale).masked_fill(~band_ok, float("-inf"))]
    values = [kv]
    chosen = index_scores = None
    if attn.compressor is not None:
        c = attn.compressor
        rows = _pool(c, x, p).float()  # [B, R, d]
        visible = _visible(L, rows.shape[1], c.ratio, x.device)[None].expand(p.B, -1, -1)
        if c.indexer is not None:
            index_scores, chosen = _indexer_selection(attn, x, qr, p, visible)
        else:
            chosen = visible
        s = torch.einsum("blhd,brd->bhlr", q, rows).mul(attn.scale)
        logits.append(s.masked_fill(~chosen[:, None], float("-inf")))
        values.append(rows)
    sink = attn.sinks.float().view(1, H, 1, 1).expand(p.B, H, L, 1)
    probs = torch.softmax(torch.cat([*logits, sink], dim=-1), dim=-1)
    out = torch.einsum("bhlw,blwd->blhd", probs[..., :W], kv_band)
    if attn.compressor is not None:
        R = values[1].shape[1]
        out = out + torch.einsum("bhlr,brd->blhd", probs[..., W : W + R], values[1])
        if index_scores is not None and torch.is_grad_enabled():
            p.indexer_losses.append(_indexer_kl(probs[..., W : W + R].detach().sum(dim=1), index_scores, chosen))
    out = b.apply_rope(out.reshape(T, H, d).to(x.dtype), p.positions, attn.inv_freq, inverse=True)
    return attn.o_b_proj(attn._grouped_o_a(out))


def _indexer_kl(mass: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Mean over queries with a selected row of KL(attention mass over the selected rows || indexer softmax)."""
    keep = chosen.any(dim=-1)
    mass, scores, chosen = mass[keep], scores[keep], chosen[keep]
    target = mass * chosen
    target = target / target.sum(dim=-1, keepdim=True).clamp(min=1e-12)
    logq = torch.log_softmax(scores.masked_fill(~chosen, -1e9), dim=-1)
    kl = torch.where(chosen, target * (torch.log(target.clamp(min=1e-12)) - logq), torch.zeros_like(target))
    return kl.sum(dim=-1).mean()


def moe(mlp: MoE, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`MoE.forward` for training, without a host sync: the reference backend's per-expert loop reads the
    experts' token counts on the host (`.tolist()`), which stalls the GPU's queue at every MoE site. Here every
    expert runs on every token and the routing weights, zero off each token's top-k, combine them: the same
    output and gradients as the sparse layer (an unchosen expert gets weight 0, so no gradient), at
    `n_routed_experts / num_experts_per_tok` times its FLOPs, which experts of width 64 make cheap next to the
    stall."""
    ids, weights = mlp.gate(x, token_ids)
    w13, w2 = mlp.experts.gate_up_proj, mlp.experts.down_proj  # [E, 2I, D], [E, D, I]
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    dense = dense.scatter_add(1, ids, weights.float())  # [T, E]
    gate, up = torch.einsum("td,efd->etf", x, w13).chunk(2, dim=-1)
    y = torch.einsum("etf,edf->etd", mlp.backend.swiglu(gate, up, mlp.limit), w2)
    routed = torch.einsum("etd,te->td", y.float(), dense)
    return routed.to(x.dtype) + mlp.shared_experts(x)


def decoder_layer(layer: DecoderLayer, streams: torch.Tensor, token_ids: torch.Tensor, p: Pass) -> torch.Tensor:
    """`DecoderLayer.forward` with the batched attention (and the sync-free MoE)."""
    norm, eps = layer.backend.rms_norm, layer.eps
    x, post, comb = layer.attn_hc.pre(streams)
    a = attention(layer.self_attn, norm(x, layer.input_layernorm.weight, eps), p)
    streams = layer.attn_hc.post(streams, a, post, comb)
    x, post, comb = layer.ffn_hc.pre(streams)
    x = norm(x, layer.post_attention_layernorm.weight, eps)
    return layer.ffn_hc.post(streams, moe(layer.mlp, x, token_ids), post, comb)


def main_streams(model: DeepseekV4ForCausalLM, ids: torch.Tensor, p: Pass) -> torch.Tensor:
    """ids [B, L] -> last-layer streams [B*L, n, D]."""
    flat = ids.reshape(-1)
    e = model.model.embed_tokens(flat)
    streams = e.unsqueeze(1).expand(-1, model.cfg.hc_mult, -1).contiguous()
    for layer in model.model.layers:
        streams = decoder_layer(layer, streams, flat, p)
    return streams


def main_forward(model: DeepseekV4ForCausalLM, ids: torch.Tensor, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] -> (last-layer streams [B*L, n, D], fp32 logits [B*L, V])."""
    streams = main_streams(model, ids, p)
    return streams, model.logits(model.model.final_hidden(streams))


def mtp_forward(model: DeepseekV4ForCausalLM, next_ids: torch.Tensor, prev_streams: torch.Tensor,
                p: Pass, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP block (V3 alignment): row (b, i) pairs `prev_streams` at position i with `next_ids[b, i]`, the
    token at i + 1, and its logits predict the token at i + 2. Returns (block streams, fp32 logits of `rows`,
    default all)."""
    block = model.mtp[0]
    norm = block.backend.rms_norm
    flat = next_ids.reshape(-1)
    e = block.e_proj(norm(model.model.embed_tokens(flat), block.enorm.weight, block.eps))
    h = block.h_proj(norm(prev_streams, block.hnorm.weight, block.eps))
    streams = decoder_layer(block, e.unsqueeze(1) + h, flat, p)
    return streams, model.logits(block.final_hidden(streams if rows is None else streams[rows]))


@torch.no_grad()
def check_against_inference(model: DeepseekV4ForCausalLM, ids: torch.Tensor, dense: bool = False) -> float:
    """Max |logit difference| between this forward and deepserve's inference forward (main model and MTP)."""
    from deepserve.model.batch import make_batch

    B, L = ids.shape
    device = model.backend.device
    p = Pass(B, L, torch.arange(L, device=device).repeat(B), dense=dense)
    streams, logits = main_forward(model, ids, p)
    states = [model.make_state() for _ in range(B)]
    ref = model(make_batch(ids.tolist(), [0] * B, device, logits_rows=[range(L)] * B), states)
    diff = (logits - ref.logits).abs().max().item()
    if model.mtp:
        pm = Pass(B, L - 1, torch.arange(L - 1, device=device).repeat(B))
        prev = streams.view(B, L, *streams.shape[1:])[:, :-1].reshape(-1, *streams.shape[1:])
        _, mtp_logits = mtp_forward(model, ids[:, 1:], prev, pm)
        nxt = ids[:, 1:].tolist()
        ref_mtp = model.mtp_forward(0, make_batch(nxt, [0] * B, device, logits_rows=[range(L - 1)] * B), states,
                                    ref.streams.view(B, L, *streams.shape[1:])[:, :-1].reshape(-1, *streams.shape[1:]))
        diff = max(diff, (mtp_logits - ref_mtp.logits).abs().max().item())
    return diff
