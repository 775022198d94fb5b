"""Pure-PyTorch implementation of every `Backend` op: runs on CPU and CUDA, and is the numerical oracle that
accelerator kernels are checked against. Written for clarity, not speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepserve.core.interfaces import Backend

from deepserve.sampling import sample as _sample


# CPU BLAS (and cuBLAS) pick other kernels for very few rows, which changes the rounding of those rows; padding
# every GEMM to at least this many rows keeps a row's result independent of the batch it is in.
MIN_GEMM_ROWS = 4


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] >= MIN_GEMM_ROWS:
        return x
    return torch.cat((x, x.new_zeros((MIN_GEMM_ROWS - x.shape[0],) + tuple(x.shape[1:]))))


def _exact(fn, x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` through float64. Vectorised CPU kernels evaluate transcendental functions with other
    approximations in a tensor's vector body than in its tail, so an element's fp32 result would depend on where
    it sits in the batch; in float64 both paths round to the same fp32 value (batch invariance)."""
    return fn(x.double()).to(x.dtype)


def _weighted_streams(weights: torch.Tensor, streams: torch.Tensor, cast: bool = True) -> torch.Tensor:
    """sum_j weights[:, j] * streams[:, j] in fp32, accumulated stream by stream in a fixed order (a tensor
    reduction here would round differently depending on how many tokens the batch holds)."""
    acc = weights[:, 0, None] * streams[:, 0].float()
    for j in range(1, streams.shape[1]):
        acc = acc + weights[:, j, None] * streams[:, j].float()
    return acc.to(streams.dtype) if cast else acc


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

    # -- GEMMs -------------------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return F.linear(_pad_rows(x), weight)[:rows]

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = torch.bmm(_pad_rows(x).transpose(0, 1), weight.transpose(1, 2))  # [G, T, N]
        return out.transpose(0, 1)[:rows]

    # -- elementwise -------------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x.float()
        y = xf * _exact(torch.rsqrt, xf.square().mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = weight.float() * y
        return y.to(x.dtype)

    def apply_rope(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
        inplace: bool = False,
    ) -> torch.Tensor:
        rd = 2 * inv_freq.shape[0]
        angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rd/2]
        cos, sin = _exact(torch.cos, angles), _exact(torch.sin, angles)
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
        flat = flat * _exact(torch.rsqrt, flat.square().mean(-1, keepdim=True) + norm_eps)
        return self.linear(flat, fn.float())

    def hc_pre(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        n = streams.shape[1]
        mix = self._hc_mix(streams, fn, norm_eps)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = scale.float().unbind(0)
        pre = _exact(torch.sigmoid, pre_w * s_pre + pre_b) + hc_eps
        post = 2 * _exact(torch.sigmoid, post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        for _ in range(iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        return _weighted_streams(pre, streams), post, comb

    def hc_post(self, streams, block_out, post, comb):
        # comb[j, k]: source stream j feeds destination k, so destination k is sum_j comb[j, k] * X_j
        out = [post[:, k, None] * block_out.float() + _weighted_streams(comb[:, :, k], streams, cast=False)
               for k in range(streams.shape[1])]
        return torch.stack(out, dim=1).to(streams.dtype)

    def hc_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        mix = self._hc_mix(streams, fn, norm_eps)
        pre = _exact(torch.sigmoid, mix * scale.float() + base.float()) + hc_eps
        return _weighted_streams(pre, streams)

    # -- attention ---------------------------------------------------------------------------------------------
    def sparse_attention(self, q, kv, indices, sinks, scale):
        # Batch invariance: each query is reduced over its own index list cut after its last valid entry, never
        # over padding that depends on the other sequences in the batch. Queries are grouped by that width.
        valid = indices >= 0
        cols = torch.arange(indices.shape[1], device=indices.device)
        width = torch.where(valid, cols + 1, torch.zeros_like(cols)).amax(dim=1) if indices.numel() else \
            torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
        out = torch.empty_like(q)
        for w in torch.unique(width).tolist():
            rows = (width == w).nonzero().squeeze(1)
            out[rows] = self._attend(q[rows], kv, indices[rows, :w], sinks, scale)
        return out

    @staticmethod
    def _attend(q, kv, indices, sinks, scale):
        valid = indices >= 0
        keys = kv[indices.clamp(min=0)]  # [T, K, d]
        scores = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat((scores, sink), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("thk,tkd->thd", probs, keys.float()).to(q.dtype)

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
        # products reduced over the last dim, not a matmul: BLAS would block the reduction differently for
        # different widths, and the width is the longest sequence in the batch (batch invariance)
        dots = (q.float()[:, :, None, :] * k[:, None, :, :]).sum(dim=-1)  # [T, Hi, width]
        scores = (torch.relu(dots) * weights.float()[:, :, None]).sum(dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        # stable descending sort: equal scores keep ascending row order, so the lowest row wins a tie
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
        chosen_ok = torch.gather(visible, 1, order)
        # ascending row order, unused slots last: the attention then reduces over keys in one canonical order
        order = torch.where(chosen_ok, order, torch.full_like(order, width)).sort(dim=-1).values
        chosen = torch.where(order < width, key_start[:, None] + order, torch.full_like(order, -1))
        out[:, : chosen.shape[1]] = chosen
        return out

    def indexer_topk_paged(self, q, weights, pages, tables, key_count, topk):
        # every table's rows gathered, then the flat op: the same scores and the same choice as over the
        # sequence's own rows (the extra keys are past every count)
        T, P = tables.shape
        width = P * pages.shape[1]
        keys = pages[tables].reshape(T * width, pages.shape[-1])
        start = torch.arange(T, device=q.device) * width
        chosen = self.indexer_topk(q, weights, keys, start, key_count, topk)
        return torch.where(chosen >= 0, chosen - start[:, None], chosen)

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
            gate, up = self.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
            h = self.swiglu(gate, up, limit)
            y = self.linear(h, w2[expert]).float() * weight_of[sel, None].float()
            out.index_add_(0, tokens, y)
        return out.to(x.dtype)

    def router_scores(self, logits):
        return _exact(lambda t: torch.sqrt(F.softplus(t)), logits.float())

    def swiglu(self, gate, up, limit):
        return _exact(F.silu, gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    # -- sampling ----------------------------------------------------------------------------------------------
    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, positions):
        return _sample(logits, temperature, top_k, top_p, min_p, seeds, positions)
