"""A V4.1 sequence's state past its last full page, packed into one fixed-size payload and back (the model's side
of the SWA host slots for V4.1; `deepserve.core.kv.swa_slots` keeps the payloads, the session directory and the
counters, as for V4).

For a sequence at n tokens with its last full page ending at B = n // P * P (B < n < B + P), the pages before B
hold its rows and B's snapshot, and the rest is in its slot of `paged.V41PagedStates`. The payload holds that
rest, for every backbone layer and then every DSpark block, in layer order:
* the window ring ([window, width], raw ring order: slot = position % window) as MXFP8: its keys are FP8 e4m3
  values with a UE8M0 scale per 32 (`numerics.fp8_fake_quant`) held in bf16, so one byte a value and one a block
  hold them exactly (checked when packed: V4's `mxfp8_encode` / `mxfp8_decode`);
* a ratio-2 kv source's open group (`kv_open`, `score_open`: [ratio, width] fp32, -inf where empty);
* a kv source's rows of the partial page, [B / ratio, n / ratio), and its index keys there (an index source),
  padded to the (P - 1) // ratio rows a partial page can hold;
then the sequence's host values, one int64 row as a page snapshot keeps them (token count, index-key publisher,
DSpark count, Engram history length, the history padded with -1).

Unlike V4's slots (MXFP8 rounding of fp32 state, `deepserve.model.swa_slots`), nothing is rounded: V4.1 runs
the reference's bf16 dataflow, where a one-ulp change moves an FP8/FP4 rounding by a whole step, so a rounded
state would change the next turn's tokens; a restored sequence is the sequence that finished, bit for bit. The
size follows from the state specs alone, whatever n is (`slot_bytes`).
"""

from __future__ import annotations

import hashlib

import torch

from ..swa_slots import MX_BLOCK, mxfp8_decode, mxfp8_encode
from .paged import V41PagedStates
from .state import V41SequenceState

_HOST_FIELDS = 4  # token count, index-key publisher, DSpark count, Engram history length (paged.py's columns)
MXFP8 = "mxfp8"  # a ring's form in the slot: its FP8 codes, then one UE8M0 scale byte per 32


def _parts(states: V41PagedStates) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each part of a slot, in order."""
    P, parts = states.page_size, []
    for owner, pools in (("layers", states.layers), ("dspark_layers", states.dspark)):
        for i, p in enumerate(pools):
            s = p.spec
            parts.append((f"{owner}.{i}.ring", MXFP8, (s.window, s.width)))
            if p.kv_open is not None:
                parts += [(f"{owner}.{i}.kv_open", torch.float32, (s.ratio, s.width)),
                          (f"{owner}.{i}.score_open", torch.float32, (s.ratio, s.width))]
            if p.rows is not None:
                parts.append((f"{owner}.{i}.rows", torch.bfloat16, ((P - 1) // s.ratio, s.width)))
            if p.keys is not None:
                parts.append((f"{owner}.{i}.index", torch.bfloat16, ((P - 1) // s.ratio, s.index_width)))
    parts.append(("sequence.host", torch.int64, (_HOST_FIELDS + states.history_size,)))
    return parts


def _nbytes(dtype: torch.dtype | str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    if dtype == MXFP8:
        n += -n % MX_BLOCK
        return n + n // MX_BLOCK
    return n * dtype.itemsize


def slot_bytes(states: V41PagedStates) -> int:
    """Bytes of one slot: the rings in MXFP8, every other part as stored."""
    return sum(_nbytes(dtype, shape) for _, dtype, shape in _parts(states))


def slot_layout(states: V41PagedStates) -> str:
    """A digest of the slot's layout (parts, dtypes, shapes, page size): a payload of another layout is a miss."""
    text = f"v41-slot-1;P={states.page_size};" + ";".join(f"{n}:{d}={s}" for n, d, s in _parts(states))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tail(p, st, base: int, n: int) -> tuple[int, int]:
    """(first row, rows) of a kv source's partial page: [base / ratio, n / ratio)."""
    first, last = base // p.spec.ratio, n // p.spec.ratio
    if st.num_rows != last or (p.keys is not None and st.num_keys != last):
        raise RuntimeError(f"layer {p.spec.layer} holds {st.num_rows} rows and {st.num_keys} index keys at "
                           f"{n} tokens (ratio {p.spec.ratio}): not a state a slot can hold")
    return first, last - first


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _ring_bytes(ring: torch.Tensor) -> bytes:
    """A ring in MXFP8, which holds its FP8 keys exactly; anything else is refused, not rounded."""
    payload = mxfp8_encode(ring)
    if not torch.equal(_ring_from(payload, tuple(ring.shape)), ring.detach().cpu()):
        raise ValueError("a window ring holds values that are not FP8 with a UE8M0 scale per 32: a slot would "
                         "round them")
    return payload


def _ring_from(payload: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    return mxfp8_decode(payload, shape[0] * shape[1]).view(shape).to(torch.bfloat16)


def pack_state(states: V41PagedStates, state: V41SequenceState) -> bytes:
    """The payload (`slot_bytes(states)` bytes) of a sequence's state past its last full page."""
    P, n = states.page_size, state.num_tokens
    base = n // P * P
    out = []
    for pools, sts in ((states.layers, state.layers), (states.dspark, state.dspark)):
        for p, st in zip(pools, sts):
            out.append(_ring_bytes(st.ring))
            if p.kv_open is not None:
                out += [_as_bytes(st.kv_open), _as_bytes(st.score_open)]
            if p.rows is None:
                continue
            first, count = _tail(p, st, base, n)
            for pool, read, width in ((p.rows, st.read_rows, p.spec.width), (p.keys, st.read_index_keys,
                                                                             p.spec.index_width)):
                if pool is None:
                    continue
                padded = torch.zeros((P - 1) // p.spec.ratio, width, dtype=pool.dtype)
                padded[:count] = read(first, count).cpu()
                out.append(_as_bytes(padded))
    history = state.engram_history
    if len(history) > states.history_size:
        raise ValueError(f"an Engram history of {len(history)} ids; a slot keeps {states.history_size}")
    publisher = -1 if state.index_key_publisher is None else state.index_key_publisher
    host = [n, publisher, state.dspark_num_tokens, len(history)] + list(history)
    out.append(_as_bytes(torch.tensor(host + [-1] * (states.history_size - len(history)), dtype=torch.int64)))
    payload = b"".join(out)
    if len(payload) != slot_bytes(states):
        raise RuntimeError(f"packed {len(payload)} bytes for a V4.1 slot of {slot_bytes(states)}")
    return payload


def unpack_state(states: V41PagedStates, table: list[int], num_tokens: int,
                 payload: bytes) -> tuple[V41SequenceState, int]:
    """A new sequence (its state and slot) at `num_tokens` tokens: the rows of the cached pages of `table` up to
    the last full page (a prefix hit; their snapshot is not read, so a page a store brought without one will do),
    the rest from `payload`. `table` must already hold the partial page, whose rows the payload's are written
    into."""
    P = states.page_size
    base = num_tokens // P * P
    if len(table) * P <= num_tokens - 1 or num_tokens == base:
        raise ValueError(f"cannot restore {num_tokens} tokens into a table of {len(table)} pages of {P}")
    if len(payload) != slot_bytes(states):
        raise ValueError(f"a V4.1 slot holds {slot_bytes(states)} bytes, got {len(payload)}")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0

    def take(dtype: torch.dtype | str, shape: tuple[int, ...], like: torch.Tensor | None = None) -> torch.Tensor:
        nonlocal offset
        size = _nbytes(dtype, shape)
        if dtype == MXFP8:
            t = _ring_from(payload[offset:offset + size], shape)
        else:
            t = raw[offset:offset + size].view(dtype).view(shape)
        offset += size
        return t if like is None else t.to(like.device)

    state, slot = states.new_sequence(table, base, from_snapshot=False)  # the payload holds what B's snapshot would
    try:
        for pools, sts in ((states.layers, state.layers), (states.dspark, state.dspark)):
            for p, st in zip(pools, sts):
                st.ring.copy_(take(MXFP8, tuple(st.ring.shape), st.ring))
                if p.kv_open is not None:
                    st.kv_open.copy_(take(torch.float32, tuple(st.kv_open.shape), st.kv_open))
                    st.score_open.copy_(take(torch.float32, tuple(st.score_open.shape), st.score_open))
                if p.rows is None:
                    continue
                count = num_tokens // p.spec.ratio - base // p.spec.ratio
                rows = take(torch.bfloat16, ((P - 1) // p.spec.ratio, p.spec.width), p.rows)
                if count:
                    st.append_rows(rows[:count])
                if p.keys is not None:
                    keys = take(torch.bfloat16, ((P - 1) // p.spec.ratio, p.spec.index_width), p.keys)
                    if count:
                        st.append_index_keys(keys[:count])
        host = take(torch.int64, (_HOST_FIELDS + states.history_size,)).tolist()
        if host[0] != num_tokens:
            raise ValueError(f"the slot holds a state at {host[0]} tokens, not {num_tokens}")
    except BaseException:
        states.free_sequence(slot)
        raise
    state.num_tokens, publisher, state.dspark_num_tokens, history_len = host[:_HOST_FIELDS]
    state.index_key_publisher = None if publisher < 0 else publisher
    state.engram_history = host[_HOST_FIELDS:_HOST_FIELDS + history_len]
    return state, slot
