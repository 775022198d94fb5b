"""Pure-PyTorch implementation of every `Backend` op: runs on CPU and CUDA, and is the numerical oracle that
accelerator kernels are checked against. Written for clarity, not speed.

With `exact=True` (the default) every reduction and transcendental function goes through `exact.py`, so a row's
result is a function of that row alone: the same bits alone or in any batch, on any CPU (the engine's batch
invariance rests on it). `exact=False` computes the same formulas with torch's own kernels: differentiable and
faster, for training, and not batch-invariant.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from deepserve.core.interfaces import Backend
from deepserve.sampling import sample as _sample

from . import exact as _ex

# the formulas' primitives, by mode: float64 results from `exact` (`_ex`), the inputs' dtype from torch
_TORCH = SimpleNamespace(
    matmul=lambda a, b, b_slices=None: torch.matmul(a, b),
    grid_sum=lambda x, dim, keepdim=False: x.sum(dim=dim, keepdim=keepdim),
    ordered_sum=lambda x, dim, keepdim=False: x.sum(dim=dim, keepdim=keepdim),
    exp=torch.exp, sigmoid=torch.sigmoid, silu=F.silu, softplus=F.softplus, rsqrt=torch.rsqrt,
    sincos=lambda x: (torch.sin(x), torch.cos(x)),
    softmax=lambda x, dim=-1: torch.softmax(x, dim=dim),
)


def _weighted_streams(weights: torch.Tensor, streams: torch.Tensor, cast: bool = True) -> torch.Tensor:
    """sum_j weights[:, j] * streams[:, j] in fp32, accumulated stream by stream in a fixed order (elementwise
    multiplies and adds only)."""
    acc = weights[:, 0, None] * streams[:, 0].float()
    for j in range(1, streams.shape[1]):
        acc = acc + weights[:, j, None] * streams[:, j].float()
    return acc.to(streams.dtype) if cast else acc


class ReferenceBackend(Backend):
    """The reference ops. Every computation that the V4 reference keeps in fp32 is done in fp32 here, or, with
    `exact=True`, in float64 and rounded to fp32 where the reference rounds (see the module docstring)."""

    name = "cpu"

    def __init__(self, device: str = "cpu", exact: bool = True) -> None:
        self._device = str(torch.device(device))
        self.exact = exact
        self._num = _ex if exact else _TORCH
        self._weight_slices = _ex.WeightSlices()
        self._rope_tables = _ex.OwnerCache()  # inv_freq -> (positions held, sin, cos [positions, rd/2] fp32)

    @property
    def device(self) -> str:
        return self._device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self._device!r}, exact={self.exact})"

    # -- GEMMs -------------------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.exact:
            return F.linear(x, weight)
        hi, lo = self._weight_slices.slices(weight)
        return _ex.matmul(x, weight.t(), b_slices=(hi.t(), lo.t())).to(x.dtype)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.exact:
            return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
        hi, lo = self._weight_slices.slices(weight)  # [G, N, K], each row sliced over K
        out = _ex.matmul(x.transpose(0, 1), weight.transpose(1, 2),
                         b_slices=(hi.transpose(1, 2), lo.transpose(1, 2)))  # [G, T, N]
        return out.transpose(0, 1).to(x.dtype)

    # -- elementwise -------------------------------------------------------------------------------------------
    def _inv_rms(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """1 / sqrt(mean(x^2) + eps) over the last dim, keepdim, fp32."""
        xf = x.double() if self.exact else x.float()
        mean = self._num.grid_sum(xf * xf, -1, keepdim=True) / x.shape[-1]
        return self._num.rsqrt(mean + eps).float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        y = x.float() * self._inv_rms(x, eps)
        if weight is not None:
            y = weight.float() * y
        return y.to(x.dtype)

    def apply_rope(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
        inplace: bool = False,
    ) -> torch.Tensor:
        rd = 2 * inv_freq.shape[0]
        sin, cos = self._sin_cos(positions, inv_freq)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -rd:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)

    def _sin_cos(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sin and cos of the angles `position * inv_freq` (fp32, as the reference forms them), [T, rd/2] fp32.
        Exact mode reads them from a table per `inv_freq` (the same values: each entry is elementwise), grown to
        the largest position seen, because the series cost more than the rest of the rotation."""
        low, high = (int(v) for v in torch.aminmax(positions)) if positions.numel() and self.exact else (-1, 0)
        if low < 0:  # torch's kernels, or not a position a table holds: these angles directly
            sin, cos = self._num.sincos(positions.float()[:, None] * inv_freq.float()[None, :])
            return sin.float(), cos.float()
        need = high + 1

        def table(freq: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
            size = max(1024, 1 << (need - 1).bit_length())
            angles = torch.arange(size, device=freq.device).float()[:, None] * freq.float()[None, :]
            sin, cos = _ex.sincos(angles)
            return size, sin.float(), cos.float()

        _, sin, cos = self._rope_tables.get(inv_freq, table, valid=lambda entry: entry[0] >= need)
        return sin[positions], cos[positions]

    # -- mHC ---------------------------------------------------------------------------------------------------
    def _hc_mix(self, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        flat = streams.flatten(1).float()
        return self.linear(flat * self._inv_rms(flat, norm_eps), fn.float())

    def _sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self._num.sigmoid(x).float()

    def hc_pre(self, streams, fn, base, scale, iters, hc_eps, norm_eps):
        n = streams.shape[1]
        mix = self._hc_mix(streams, fn, norm_eps)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = scale.float().unbind(0)
        gates = self._sigmoid(torch.cat((pre_w * s_pre + pre_b, post_w * s_post + post_b), dim=-1))  # one series
        pre, post = gates[:, :n] + hc_eps, 2 * gates[:, n:]
        total = self._num.ordered_sum
        comb = self._num.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1).float() + hc_eps
        comb = comb / (total(comb, -2, keepdim=True) + hc_eps)
        for _ in range(iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (total(comb, -1, keepdim=True) + hc_eps)
            comb = comb / (total(comb, -2, keepdim=True) + hc_eps)
        return _weighted_streams(pre, streams), post, comb

    def hc_post(self, streams, block_out, post, comb):
        # comb[j, k]: source stream j feeds destination k, so destination k is sum_j comb[j, k] * X_j
        out = [post[:, k, None] * block_out.float() + _weighted_streams(comb[:, :, k], streams, cast=False)
               for k in range(streams.shape[1])]
        return torch.stack(out, dim=1).to(streams.dtype)

    def hc_head(self, streams, fn, base, scale, hc_eps, norm_eps):
        mix = self._hc_mix(streams, fn, norm_eps)
        pre = self._sigmoid(mix * scale.float() + base.float()) + hc_eps
        return _weighted_streams(pre, streams)

    # -- attention ---------------------------------------------------------------------------------------------
    def sparse_attention(self, q, kv, indices, sinks, scale):
        # Batch invariance: the index lists are padded (-1) to the longest in the batch; a padded entry's key is
        # zero and its logit -inf, which the exact sums and products ignore, so a query's result does not depend
        # on the padding (the torch mode is not batch-invariant anyway).
        valid = indices >= 0
        keys = torch.where(valid[..., None], kv[indices.clamp(min=0)].float(), 0.0)  # [T, K, d]
        num = self._num
        scores = num.matmul(q.float(), keys.transpose(1, 2)) * scale  # [T, H, K]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        sink = sinks.to(scores.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = num.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return num.matmul(probs, keys).to(q.dtype)

    def indexer_topk(self, q, weights, keys, key_start, key_count, topk):
        T = q.shape[0]
        width = int(key_count.max().item()) if T else 0
        out = torch.full((T, topk), -1, dtype=torch.long, device=q.device)
        if width == 0:
            return out
        offs = torch.arange(width, device=q.device)
        visible = offs[None, :] < key_count[:, None]
        rows = (key_start[:, None] + offs[None, :]).clamp(max=max(keys.shape[0] - 1, 0))
        k = keys[rows].float()  # [T, width, Di]; a key's score depends on that key alone, so the width is free
        dots = self._num.matmul(q.float(), k.transpose(1, 2))  # [T, Hi, width]
        scores = self._num.grid_sum(torch.relu(dots) * weights.to(dots.dtype)[:, :, None], 1)
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

    # -- compression -------------------------------------------------------------------------------------------
    def softmax_pool(self, values, gates):
        weights = self._num.softmax(gates.float(), dim=1).float()
        return self._num.grid_sum(values.float() * weights, 1).float()

    # -- MoE ---------------------------------------------------------------------------------------------------
    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        return self._experts(x, topk_ids, topk_weights, w13.shape[0], w13.__getitem__, w2.__getitem__, limit)

    def quantized_moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        # the oracle: each expert the step routes to, dequantized as the loader would (never the whole stack)
        return self._experts(x, topk_ids, topk_weights, w13.shape[0], lambda e: w13.expert(e).dequantize(x.dtype),
                             lambda e: w2.expert(e).dequantize(x.dtype), limit)

    def _experts(self, x, topk_ids, topk_weights, num_experts, w13_of, w2_of, limit):
        # each token's experts are added in ascending expert order, whatever else the batch routes
        out = torch.zeros_like(x, dtype=torch.float32)
        flat_ids = topk_ids.reshape(-1)
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
        weight_of = topk_weights.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            sel = order[start : start + count]
            start += count
            tokens = token_of[sel]
            gate, up = self.linear(x[tokens], w13_of(expert)).chunk(2, dim=-1)
            h = self.swiglu(gate, up, limit)
            y = self.linear(h, w2_of(expert)).float() * weight_of[sel, None].float()
            out.index_add_(0, tokens, y)
        return out.to(x.dtype)

    def route(self, logits, bias, hash_ids, top_k, scale):
        scores = self.router_scores(logits)
        # the bias steers selection only; the weights come from the unbiased scores
        ids = hash_ids if hash_ids is not None else torch.topk(scores + bias, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        total = self._num.ordered_sum(weights.double() if self.exact else weights, -1, keepdim=True).float()
        return ids, weights / (total + 1e-20) * scale

    def router_scores(self, logits):
        return torch.sqrt(self._num.softplus(logits.float())).float()

    def swiglu(self, gate, up, limit):
        return self._num.silu(gate.clamp(max=limit)).to(gate.dtype) * up.clamp(min=-limit, max=limit)

    # -- sampling ----------------------------------------------------------------------------------------------
    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, positions):
        return _sample(logits, temperature, top_k, top_p, min_p, seeds, positions)
