"""A sequence's window state past its last full page, packed into one fixed-size MXFP8 payload and back (the
model's side of the SWA host slots: `deepserve.core.kv.swa_slots` keeps the payloads and their directory).

For a sequence at n tokens with its last full page ending at B = n // P * P, every layer of every allocated state
owner contributes, in order: its window ring ([window, width], raw ring order), and per compressed stream (main,
then indexer) the open block's projections (`open_kv`, `open_gate`: [ratio, frontier width]), CSA's overlap half
(`prev_kv`, `prev_gate`: [ratio, dim]) and the stream's rows of the partial page, [B / ratio, n / ratio), padded
to the (P - 1) // ratio rows a partial page can hold. So the slot's size follows from the declared
`LayerStateSpec`s alone, whatever n is.

MXFP8 (OCP Microscaling): the values in blocks of 32, each block one UE8M0 scale 2^e (a uint8 e + 127, e the
smallest exponent with amax / 2^e <= 448, as DeepSeek's UE8M0 rule) and 32 e4m3 values. Round-trip error of a
value x in a block of scale 2^e: at most |x| / 16 (three mantissa bits, round to nearest) or 2^(e - 10) (e4m3's
subnormal step halved), whichever is larger (`mxfp8_error_bound`).
"""

from __future__ import annotations

import hashlib

import torch

from .kv_cache import PagedKVCache
from .state import SequenceState

MX_BLOCK = 32
E4M3_MAX = 448.0


def mxfp8_encode(values: torch.Tensor) -> bytes:
    """fp32 values (any shape; flattened, zero-padded to a multiple of 32) -> e4m3 bytes then one scale byte per
    32 values."""
    flat = values.detach().reshape(-1).float().cpu()
    pad = -flat.numel() % MX_BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, MX_BLOCK)
    exponent = _exponent(blocks.abs().amax(dim=1))
    scaled = blocks / torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)[:, None]
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.numpy().tobytes() + (exponent + 127).to(torch.uint8).numpy().tobytes()


def mxfp8_decode(payload: bytes, num_values: int) -> torch.Tensor:
    """The first `num_values` fp32 values of an `mxfp8_encode` payload."""
    padded = num_values + (-num_values % MX_BLOCK)
    if len(payload) < padded + padded // MX_BLOCK:
        raise ValueError(f"an MXFP8 payload of {num_values} values needs {padded + padded // MX_BLOCK} bytes, "
                         f"got {len(payload)}")
    raw = torch.frombuffer(bytearray(payload[:padded + padded // MX_BLOCK]), dtype=torch.uint8)
    codes = raw[:padded].view(torch.float8_e4m3fn).float().view(-1, MX_BLOCK)
    exponent = raw[padded:].to(torch.int32) - 127
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return (codes * scale[:, None]).reshape(-1)[:num_values]


def mxfp8_error_bound(values: torch.Tensor) -> torch.Tensor:
    """Per value, the most an MXFP8 round trip may move it (see the module's docstring)."""
    flat = values.detach().reshape(-1).float().cpu()
    pad = -flat.numel() % MX_BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, MX_BLOCK)
    scale = torch.ldexp(torch.ones(blocks.shape[0]), _exponent(blocks.abs().amax(dim=1)))
    bound = torch.maximum(blocks.abs() / 16, (scale * 2.0 ** -10)[:, None])
    return bound.reshape(-1)[: flat.numel()].view(values.shape)


def _exponent(amax: torch.Tensor) -> torch.Tensor:
    safe = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX))
    return torch.ceil(torch.log2(safe.double() / E4M3_MAX)).clamp(-127, 127).to(torch.int32)


# -- the slot's layout -----------------------------------------------------------------------------------------
def _parts(cache: PagedKVCache) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each part of a slot, in order."""
    P = cache.page_size
    parts = []
    for owner, layers in cache.pools.items():
        for i, layer in enumerate(layers):
            spec = layer.spec
            parts.append((f"{owner}.{i}.window", (spec.window, spec.width)))
            for name, s in (("compressor", spec.compressor), ("indexer", spec.indexer)):
                if s is None:
                    continue
                parts += [(f"{owner}.{i}.{name}.open_kv", (s.ratio, s.frontier_width)),
                          (f"{owner}.{i}.{name}.open_gate", (s.ratio, s.frontier_width))]
                if s.overlap:
                    parts += [(f"{owner}.{i}.{name}.prev_kv", (s.ratio, s.dim)),
                              (f"{owner}.{i}.{name}.prev_gate", (s.ratio, s.dim))]
                parts.append((f"{owner}.{i}.{name}.rows", ((P - 1) // s.ratio, s.dim)))
    return parts


def slot_num_values(cache: PagedKVCache) -> int:
    return sum(_numel(shape) for _, shape in _parts(cache))


def slot_bytes(cache: PagedKVCache) -> int:
    """Bytes of one slot: every value one e4m3 byte, one scale byte per 32."""
    n = slot_num_values(cache)
    n += -n % MX_BLOCK
    return n + n // MX_BLOCK


def slot_layout(cache: PagedKVCache) -> str:
    """A digest of the slot's layout (parts, shapes, page size, format): a payload of another layout is a miss."""
    text = f"mxfp8/{MX_BLOCK};P={cache.page_size};" + ";".join(f"{n}={s}" for n, s in _parts(cache))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- a sequence's state into a payload and back ----------------------------------------------------------------
def _streams(layer, st):
    return [(layer.compressor, st.compressor), (layer.indexer, st.indexer)]


def state_values(cache: PagedKVCache, state: SequenceState) -> torch.Tensor:
    """The slot's values (fp32, flat) of a sequence at `state.num_tokens` tokens, unquantized."""
    P, n = cache.page_size, state.num_tokens
    base = n // P * P
    out = []
    for owner, layers in cache.pools.items():
        states = state.layers if owner == cache.model.main_state_owner else getattr(state, owner)
        for layer, st in zip(layers, states):
            out.append(st.window.values().float().reshape(-1))
            for pools, comp in _streams(layer, st):
                if pools is None:
                    continue
                s = pools.spec
                out += [comp.open_kv.reshape(-1), comp.open_gate.reshape(-1)]
                if s.overlap:
                    out += [comp.prev_kv.reshape(-1), comp.prev_gate.reshape(-1)]
                rows = torch.zeros(((P - 1) // s.ratio, s.dim), dtype=torch.float32, device=comp.open_kv.device)
                first, last = base // s.ratio, n // s.ratio
                if last > first:
                    rows[: last - first] = comp.rows.read(first, last).float()
                out.append(rows.reshape(-1))
    return torch.cat([t.float().cpu() for t in out])


def pack_state(cache: PagedKVCache, state: SequenceState) -> bytes:
    """The MXFP8 payload (`slot_bytes(cache)` bytes) of a sequence's state past its last full page."""
    payload = mxfp8_encode(state_values(cache, state))
    if len(payload) != slot_bytes(cache):
        raise RuntimeError(f"packed {len(payload)} bytes for a slot of {slot_bytes(cache)}")
    return payload


def unpack_state(cache: PagedKVCache, table: list[int], num_tokens: int, payload: bytes) -> tuple[SequenceState, int]:
    """A new sequence (a cache slot and its state) at `num_tokens` tokens: the cached pages of `table` up to the
    last full page, the rest from `payload`. `table` must already hold the partial page."""
    P = cache.page_size
    base = num_tokens // P * P
    if len(table) * P <= num_tokens - 1 or num_tokens == base:
        raise ValueError(f"cannot restore {num_tokens} tokens into a table of {len(table)} pages of {P}")
    values = mxfp8_decode(payload, slot_num_values(cache))
    state, slot = cache.new_sequence(table, base)
    offset = 0

    def take(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        nonlocal offset
        n = _numel(shape)
        chunk = values[offset:offset + n].view(shape)
        offset += n
        return chunk.to(dtype=dtype or like.dtype, device=like.device)

    try:
        for owner, layers in cache.pools.items():
            states = state.layers if owner == cache.model.main_state_owner else getattr(state, owner)
            for layer, st in zip(layers, states):
                # the ring in slot order, as `state_values` reads it (encoded into the cache's stored form)
                st.window.write(0, take((layer.spec.window, layer.spec.width), st.window.ring, layer.dtype))
                for pools, comp in _streams(layer, st):
                    if pools is None:
                        continue
                    s = pools.spec
                    comp.open_kv.copy_(take(comp.open_kv.shape, comp.open_kv))
                    comp.open_gate.copy_(take(comp.open_gate.shape, comp.open_gate))
                    if s.overlap:
                        comp.prev_kv.copy_(take(comp.prev_kv.shape, comp.prev_kv))
                        comp.prev_gate.copy_(take(comp.prev_gate.shape, comp.prev_gate))
                    rows = take(((P - 1) // s.ratio, s.dim), comp.rows.pool, layer.dtype)
                    num_new = num_tokens // s.ratio - base // s.ratio
                    if num_new:
                        comp.rows.append(rows[:num_new])
    except BaseException:
        cache.free_sequence(slot)
        raise
    state.num_tokens = state.mtp_num_tokens = num_tokens
    return state, slot
