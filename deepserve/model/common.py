"""Small parameter holders shared by the V4 modules."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from deepserve.core.interfaces import Backend

from .quant import QuantizedWeight, scale_name


class NormWeight(nn.Module):
    """The learned scale of an RMSNorm, kept in fp32 like the reference; the backend applies the norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))


def keep_stored(module: nn.Module, param: str, data: torch.Tensor, scale: torch.Tensor,
                block: tuple[int, int]) -> None:
    """Make `module.<param>` hold a weight as stored (`quant.QuantizedWeight`): the parameter takes `data`'s dtype
    and shape (FP8 e4m3, or packed FP4 int8) and a buffer `<param>_scale_inv` the scales, so the module's
    `state_dict` names are the checkpoint's (`q_a_proj.weight`, `q_a_proj.weight_scale_inv`). Only the shapes and
    dtypes are taken here; `loader.load_weights` copies the values in."""
    device = getattr(module, param).device
    setattr(module, param, nn.Parameter(torch.empty(data.shape, dtype=data.dtype, device=device), requires_grad=False))
    module.register_buffer(scale_name(param), torch.empty(scale.shape, dtype=scale.dtype, device=device))
    module.__dict__.setdefault("stored_blocks", {})[param] = tuple(block)


def stored(module: nn.Module, param: str) -> QuantizedWeight | None:
    """`module.<param>` as stored (see `keep_stored`), or None for a plain weight."""
    block = module.__dict__.get("stored_blocks", {}).get(param)
    if block is None:
        return None
    return QuantizedWeight(getattr(module, param), getattr(module, scale_name(param)), block)


class Linear(nn.Module):
    """A bias-free projection whose GEMM is the backend's (batch-invariant, FP8-capable where the backend is).
    Accepts [..., in_features]. A weight kept as stored (`keep_stored`) goes through the backend's
    `quantized_linear`."""

    def __init__(self, backend: Backend, in_features: int, out_features: int) -> None:
        super().__init__()
        self.backend = backend
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.shared: SharedInput | None = None  # set by `SharedInput`: this projection's GEMM is the group's

    def stored(self) -> QuantizedWeight | None:
        return stored(self, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared.columns(self, x)
        lead = x.shape[:-1]
        q = self.stored()
        if q is not None:
            return self.backend.quantized_linear(x.reshape(-1, x.shape[-1]), q).view(*lead, -1)
        return self.backend.linear(x.reshape(-1, x.shape[-1]), self.weight).view(*lead, -1)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal use of the weight: x [T, G, K], rows split into G equal groups -> [T, G, N / G]."""
        q = self.stored()
        if q is not None:
            return self.backend.quantized_grouped_linear(x, q)
        return self.backend.grouped_linear(x, self.weight.view(x.shape[1], -1, x.shape[-1]))


class SharedInput:
    """Projections that read the same input, multiplied as one GEMM over their weights stacked by rows.

    A decode step multiplies one to 64 rows; cuBLAS then spends a launch (and often a split-K reduction) per
    projection, whatever its size, so a CSA layer's seven projections of its normed input (q_a, kv, the
    compressor's and the indexer's kv and gate, the indexer's head weights) cost seven GEMMs where one will do.
    The members keep their parameters (now views into the stacked weight, so loading into them still works)
    and their call sites: the first member called on an input runs the group's GEMM, each member then takes its
    columns of that output, and once every member has taken its part the output is let go. A member called on
    another input, or twice on one, runs the GEMM again: slower, never wrong.
    """

    def __init__(self, backend: Backend, members: list[Linear]) -> None:
        self.backend = backend
        first = members[0].stored()
        # stored members (`keep_stored`): their data and their scales stacked by rows, whole scale blocks each
        self.block = first.block if first is not None else None
        self.weight = torch.cat([m.weight.data for m in members])
        self.scale = torch.cat([m.stored().scale for m in members]) if first is not None else None
        self.spans: dict[Linear, tuple[int, int]] = {}
        start = 0
        for m in members:
            n = m.weight.shape[0]
            m.weight.data = self.weight[start : start + n]
            if self.scale is not None:
                m.weight_scale_inv = self.scale[start // self.block[0] : (start + n) // self.block[0]]
            self.spans[m] = (start, start + n)
            m.shared = self
            start += n
        self._input: weakref.ref | None = None
        self._output: torch.Tensor | None = None
        self._waiting: set[Linear] = set()

    def columns(self, member: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._input is None or self._input() is not x or member not in self._waiting:
            flat = x.reshape(-1, x.shape[-1])
            self._output = self.backend.linear(flat, self.weight) if self.scale is None else \
                self.backend.quantized_linear(flat, QuantizedWeight(self.weight, self.scale, self.block))
            self._input, self._waiting = weakref.ref(x), set(self.spans)
        a, b = self.spans[member]
        out = self._output[:, a:b].view(*x.shape[:-1], b - a)
        self._waiting.discard(member)
        if not self._waiting:
            self._input = self._output = None
        return out


_STACKABLE = (torch.float32, torch.bfloat16, torch.float16)


def share_input(backend: Backend, members: list[Linear]) -> SharedInput | None:
    """Group `members` (see `SharedInput`) when they can be stacked: plain weights of one dtype and device and
    the same input width, none in a group already. Returns the group, or None."""
    weights = [m.weight for m in members]
    if len(members) < 2 or any(m.shared is not None for m in members):
        return None
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or weights[0].dtype not in _STACKABLE:
        return None
    return SharedInput(backend, members)


def share_inputs(backend: Backend, members: list[Linear]) -> list[SharedInput]:
    """Group `members` by what can be stacked together (see `SharedInput`): plain weights of one dtype, device and
    input width; stored weights (`keep_stored`) of one format, block, device and input width whose rows are whole
    scale blocks. Members in a group already are left out. Returns the groups made (two members or more each)."""
    kinds: dict[tuple, list[Linear]] = {}
    for m in members:
        if m.shared is not None:
            continue
        w, q = m.weight, m.stored()
        if q is None and w.dtype in _STACKABLE:
            key = ("plain", w.dtype, w.device, w.shape[1])
        elif q is not None and w.shape[0] % q.block[0] == 0:
            key = ("stored", w.dtype, q.scale.dtype, q.block, w.device, w.shape[1])
        else:
            continue
        kinds.setdefault(key, []).append(m)
    return [SharedInput(backend, group) for group in kinds.values() if len(group) >= 2]


def linear(backend: Backend, in_features: int, out_features: int) -> Linear:
    return Linear(backend, in_features, out_features)
