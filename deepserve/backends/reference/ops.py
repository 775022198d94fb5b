"""Pure-PyTorch implementation of every `Backend` op: runs on CPU and CUDA, and is the numerical oracle that
accelerator kernels are checked against. Written for clarity, not speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepserve.core.interfaces import Backend

from .sampling import sample as _sample


class ReferenceBackend(Backend):
    """The reference ops. Every computation that the V4 reference keeps in fp32 is done in fp32 here."""

    name = "cpu"

    def __init__(self, device: str = "cpu") -> None:
        self._device = str(torch.device(device))

    @property
    def device(self) -> str:
        return self._device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self._device!r})"

    # -- elementwise -------------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = weight.float() * y
        return y.to(x.dtype)

    def apply_rope(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        rd = 2 * inv_freq.shape[0]
        angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rd/2]
        cos, sin = angles.cos(), angles.sin()
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -rd:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)

    # -- mHC ---------------------------------------------------------------------------------------------------
    def _hc_mix(self, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        return F.linear(flat, fn.float())

    def hc_pre(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        n = streams.shape[1]
        mix = self._hc_mix(streams, fn, norm_eps)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        for _ in range(iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    def hc_post(self, streams, block_out, post, comb):
        dtype = streams.dtype
        # comb[j, k]: source stream j feeds destination k, so the mix is comb^T @ X
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed

    def hc_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        mix = self._hc_mix(streams, fn, norm_eps)
        pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    # -- attention ---------------------------------------------------------------------------------------------
    def sparse_attention(self, q, kv, indices, sinks, scale):
        valid = indices >= 0
        keys = kv[indices.clamp(min=0)]  # [T, K, d]
        scores = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat((scores, sink), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out = torch.einsum("thk,tkd->thd", probs, keys.float())
        return out.to(q.dtype)

    def indexer_topk(self, q, weights, keys, key_start, key_count, topk):
        T = q.shape[0]
        width = int(key_count.max().item()) if T else 0
        out = torch.full((T, topk), -1, dtype=torch.long, device=q.device)
        if width == 0:
            return out
        offs = torch.arange(width, device=q.device)
        visible = offs[None, :] < key_count[:, None]
        rows = (key_start[:, None] + offs[None, :]).clamp(max=max(keys.shape[0] - 1, 0))
        k = keys[rows].float()  # [T, width, Di]
        dots = torch.einsum("thd,twd->thw", q.float(), k)
        scores = (torch.relu(dots) * weights.float()[:, :, None]).sum(dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        # stable descending sort: equal scores keep ascending row order, so the lowest row wins a tie
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
        chosen_ok = torch.gather(visible, 1, order)
        chosen = torch.where(chosen_ok, key_start[:, None] + order, torch.full_like(order, -1))
        out[:, : chosen.shape[1]] = chosen
        return out

    # -- MoE ---------------------------------------------------------------------------------------------------
    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        out = torch.zeros_like(x, dtype=torch.float32)
        flat_ids = topk_ids.reshape(-1)
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
        weight_of = topk_weights.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            sel = order[start : start + count]
            start += count
            tokens = token_of[sel]
            gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
            h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            y = F.linear(h, w2[expert]).float() * weight_of[sel, None].float()
            out.index_add_(0, tokens, y)
        return out.to(x.dtype)

    # -- sampling ----------------------------------------------------------------------------------------------
    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, positions):
        return _sample(logits, temperature, top_k, top_p, min_p, seeds, positions)
