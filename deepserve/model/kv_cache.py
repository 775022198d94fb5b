"""The paged V4 cache: preallocated tensors behind the block tables that `deepserve.core.kv` keeps.

Per layer and per compressed stream, a pool of pages: page p holds the rows of tokens [k*P, (k+1)*P) of the
sequence whose block table lists p at index k (CSA rows and indexer keys: P/4 rows per page; HCA rows: P/128).
Pages are shared between sequences with a common prefix. Per sequence, a *slot* holds what is not paged: the
window ring and the compression frontier of every layer.

Prefix reuse needs more than the shared rows (spec 4.4): a sequence that resumes at page boundary B also needs
the raw window rows of [B - window, B) and the CSA overlap state at B. These are *stored*, not recomputed
(recomputing them exactly means re-running every layer over a growing cone of earlier tokens): whenever a
forward pass crosses a page boundary, each layer copies its window tail and overlap state at that boundary into
the page's snapshot slot, and a prefix hit at B restores them from the last hit page. The open compression
blocks are empty at a page boundary because the page size is a multiple of every compression ratio.

Storage follows the model's declared state owners (`model.state_owners()`): with speculative decoding the
drafter's owner (V4: the MTP blocks, `mtp_layers`) is allocated too, and its window rings get slots and page
snapshots the same way (they are window-only layers), so a prefix hit restores the drafter's state too. The
cache knows no owner by name: the model builds each sequence's `SequenceState` from the owners' states.

Every row is kept in the stored form of the model's `kv_cache_dtype` (`model.kv_precision`; `fp8`: e4m3 bytes with
bf16 RoPE dims and scale bytes, FP4-packed indexer keys), so a page costs `bytes_per_page(precision=...)`; reads
decode only the rows a step gathers (`layouts`), and the cache tiers copy the stored bytes as they are.

Beyond the `num_slots` slots and `num_pages` pages it hands out, the cache keeps one *padding slot* and one
*trash page*: a fixed-shape decode step (`deepserve.model.cuda_graphs`) runs its padding rows on the padding slot
and sends every write it does not want (a block that did not close, a table entry past a sequence's pages) to
the trash page, so no real row is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .batch import to_device
from .deepseek_v4 import DeepseekV4ForCausalLM
from .kv_precision import KVPrecision, RowCodec
from .state import AttentionState, CompressorState, LayerStateSpec, SequenceState, StreamSpec, WindowRing

logger = logging.getLogger(__name__)


class PagedRows:
    """A `RowStore` look-alike over pages: row r of the sequence lives in page `table[r // per_page]`, in the
    pool's stored form (`codec`: rows are encoded as they are appended and decoded as they are read)."""

    __slots__ = ("pool", "table", "per_page", "num_rows", "codec")

    def __init__(self, pool: torch.Tensor, table: list[int], num_rows: int, codec: RowCodec) -> None:
        self.pool, self.table, self.per_page, self.num_rows = pool, table, pool.shape[1], num_rows
        self.codec = codec

    def _where(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(start, end, device=self.pool.device)
        pages = to_device(self.table[: (end + self.per_page - 1) // self.per_page], torch.long, self.pool.device)
        return pages[rows // self.per_page], rows % self.per_page

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end), decoded."""
        pages, slots = self._where(start, end)
        return self.codec.decode(self.pool[pages, slots])

    def view(self) -> torch.Tensor:
        return self.read(0, self.num_rows)

    def append(self, rows: torch.Tensor) -> None:
        end = self.num_rows + rows.shape[0]
        if end > len(self.table) * self.per_page:
            raise RuntimeError(f"block table holds {len(self.table)} pages, too few for {end} rows")
        pages, slots = self._where(self.num_rows, end)
        self.pool[pages, slots] = self.codec.encode(rows)
        self.num_rows = end

    def truncate(self, num_rows: int) -> None:
        if not 0 <= num_rows <= self.num_rows:
            raise ValueError(f"cannot truncate {self.num_rows} rows to {num_rows}")
        self.num_rows = num_rows


class _StreamPools:
    """Pages, frontier slots and page snapshots of one compressed stream of one layer. The pages hold the rows in
    `codec`'s stored form; the frontier and the CSA overlap state stay fp32."""

    def __init__(self, spec: StreamSpec, num_pages: int, page_size: int, num_slots: int, codec: RowCodec, device,
                 rows: torch.Tensor | None = None) -> None:
        self.spec, self.codec = spec, codec
        self.rows = rows if rows is not None else torch.zeros(
            (num_pages, page_size // spec.ratio, codec.stored_width), dtype=codec.storage_dtype, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.open_kv = torch.zeros((num_slots, spec.ratio, spec.frontier_width), **f32)
        self.open_gate = torch.zeros((num_slots, spec.ratio, spec.frontier_width), **f32)
        overlap = (num_slots, spec.ratio, spec.dim) if spec.overlap else (0,)
        self.prev_kv, self.prev_gate = torch.zeros(overlap, **f32), torch.zeros(overlap, **f32)
        snap = (num_pages, spec.ratio, spec.dim) if spec.overlap else (0,)
        self.snap_kv, self.snap_gate = torch.zeros(snap, **f32), torch.zeros(snap, **f32)

    def state(self, slot: int, table: list[int], num_rows: int, cleared: list[torch.Tensor]) -> CompressorState:
        """The stream's state for the sequence in `slot`; its open frontier goes into `cleared` (to be zeroed)."""
        o = self.spec.overlap
        open_kv, open_gate = self.open_kv[slot], self.open_gate[slot]
        cleared += (open_kv, open_gate)
        return CompressorState(
            PagedRows(self.rows, table, num_rows, self.codec), open_kv, open_gate,
            self.prev_kv[slot] if o else None, self.prev_gate[slot] if o else None,
            self.snap_kv if o else None, self.snap_gate if o else None,
        )


class _LayerPools:
    """One layer's pools. The window rings, the main compressor's row pages and a scratch region for a step's new
    kv rows are views of ONE tensor, `storage` [num_slots * window + num_pages * rows_per_page + scratch, stored
    width]: ring row (slot, position) is storage row slot * window + position % window, compressed row r of a
    sequence with block table t is `comp_base + t[r // rpp] * rpp + r % rpp`, and the step's new rows start at
    `scratch_base`. Attention then indexes keys by these global row numbers with no copy of the pools (the
    paged layout, `layouts.paged`).

    Every row is kept in `codec`'s stored form (`precision.kv_codec`; the indexer's keys in
    `precision.index_key_codec`): at the model dtype (`auto`), bf16, or FP8 bytes (`fp8`: e4m3 codes, bf16 RoPE
    dims, scale bytes; FP4 indexer keys). `dtype` is the values' dtype, what a read decodes to. Where the codec
    holds the values themselves, kernels read the storage in place; else a step decodes the rows it gathers."""

    def __init__(self, spec: LayerStateSpec, num_pages, page_size, num_slots, dtype, device,
                 scratch_rows: int = 0, precision: KVPrecision = KVPrecision()) -> None:
        self.spec, self.dtype = spec, dtype
        W, width, comp = spec.window, spec.width, spec.compressor
        rpp = page_size // comp.ratio if comp is not None else 0
        if comp is not None and comp.dim != width:
            raise ValueError(f"compressed rows ({comp.dim}) and window rows ({width}) must be equally wide")
        self.rows_per_page = rpp
        self.comp_base = num_slots * W
        self.scratch_base = self.comp_base + num_pages * rpp
        self.scratch_rows = scratch_rows
        self.codec = codec = precision.kv_codec(width, dtype)
        stored = dict(dtype=codec.storage_dtype, device=device)
        self.storage = torch.zeros((self.scratch_base + scratch_rows, codec.stored_width), **stored)
        self.window = self.storage[: self.comp_base].view(num_slots, W, codec.stored_width)
        self.snap_window = torch.zeros((num_pages, W, codec.stored_width), **stored)
        self.compressor = _StreamPools(
            comp, num_pages, page_size, num_slots, codec, device,
            rows=self.storage[self.comp_base : self.scratch_base].view(num_pages, rpp, codec.stored_width),
        ) if comp else None
        self.indexer = _StreamPools(spec.indexer, num_pages, page_size, num_slots,
                                    precision.index_key_codec(spec.indexer.dim, dtype), device) \
            if spec.indexer else None

    def state(self, slot: int, table: list[int], num_tokens: int, cleared: list[torch.Tensor]) -> AttentionState:
        """The layer's state for the sequence in `slot`; its window ring and open frontiers go into `cleared`."""
        window = self.window[slot]
        cleared.append(window)

        def stream(pools: _StreamPools | None) -> CompressorState | None:
            return None if pools is None else pools.state(slot, table, num_tokens // pools.spec.ratio, cleared)

        return AttentionState(WindowRing(window, self.codec), stream(self.compressor),
                              stream(self.indexer), self.snap_window, slot=slot, pools=self)

    def restore(self, st: AttentionState, page: int, boundary: int) -> None:
        """Load the window tail and overlap state saved at `boundary` (the end of `page`)."""
        st.window.write_stored(boundary - self.spec.window, self.snap_window[page])
        for comp in (st.compressor, st.indexer):
            if comp is not None and comp.prev_kv is not None:
                comp.prev_kv.copy_(comp.snap_prev_kv[page])
                comp.prev_gate.copy_(comp.snap_prev_gate[page])


def owned_specs(model: DeepseekV4ForCausalLM, owners: Sequence[str] | None) -> dict[str, list[LayerStateSpec]]:
    """The state the model declares (`model.state_owners()`: owner -> its layers' specs), narrowed to `owners`
    (None: the model's `default_state_owners`). An owner the model does not declare is an error naming both."""
    declared = model.state_owners()
    owners = model.default_state_owners if owners is None else tuple(owners)
    unknown = [o for o in owners if o not in declared]
    if unknown:
        raise ValueError(f"the model declares no state owner {unknown}; it declares {sorted(declared)}")
    return {o: declared[o] for o in owners}


def bytes_per_page(model: DeepseekV4ForCausalLM, page_size: int, dtype: torch.dtype,
                   owners: Sequence[str] | None = None, precision: KVPrecision | None = None) -> int:
    """Device bytes one page costs: every allocated layer's rows for P tokens plus the page's boundary snapshot,
    with the rows at `dtype`; or, given a `precision`, in that precision's stored form (`KVPrecision.kv_row_bytes`
    / `index_key_bytes`: bf16 rows, or FP8 KV rows and FP4 indexer keys). `PagedKVCache` allocates the stored form
    of the model's precision: `bytes_per_page(..., precision=model.kv_precision)` (tests/test_kv_fp8_packed.py)."""
    specs = [spec for owned in owned_specs(model, owners).values() for spec in owned]
    return specs_bytes_per_page(specs, page_size, dtype, precision)


def model_precision(model) -> KVPrecision:
    """The KV precision `kv_precision.use_kv_cache_dtype` gave `model` (`auto` if none)."""
    return getattr(model, "kv_precision", None) or KVPrecision()


def specs_bytes_per_page(specs: Sequence[LayerStateSpec], page_size: int, dtype: torch.dtype,
                         precision: KVPrecision | None = None) -> int:
    """`bytes_per_page` of the layers `specs` (the CSA overlap snapshot stays fp32 in every precision)."""
    item = torch.tensor([], dtype=dtype).element_size()
    precision = precision or KVPrecision()  # "auto": the rows at `dtype`
    total = 0
    for spec in specs:
        total += spec.window * precision.kv_row_bytes(spec.width, item)
        for s in spec.streams():
            row = precision.index_key_bytes(s.dim, item) if s is spec.indexer else precision.kv_row_bytes(s.dim, item)
            total += (page_size // s.ratio) * row + (2 * s.ratio * s.dim * 4 if s.overlap else 0)
    return total


class PagedKVCache:
    """Pools for `num_pages` pages of `page_size` tokens and `num_slots` concurrent sequences."""

    def __init__(self, model: DeepseekV4ForCausalLM, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype | None = None, device=None, owners: Sequence[str] | None = None,
                 max_step_tokens: int | None = None) -> None:
        """`owners`: which of the model's declared state owners get storage (`model.state_owners()`; None: the
        model's defaults; a speculative proposer adds the drafter's). `max_step_tokens`: the most new tokens a
        step may bring for the batched path (each layer keeps a scratch region of that many rows for them);
        default 16 per slot (a decode token plus 15 drafts); `build_engine` passes `max_num_batched_tokens` so
        that prompt chunks fit too. Larger steps take the general path."""
        self.model = model
        specs = owned_specs(model, owners)
        for spec in (spec for owned in specs.values() for spec in owned):
            if spec.window > page_size:
                raise ValueError(f"page_size {page_size} must be at least the sliding window {spec.window}")
            for s in spec.streams():
                if page_size % s.ratio:
                    raise ValueError(f"page_size {page_size} must be a multiple of every compression ratio ({s.ratio})")
        dtype = dtype or model.lm_head.weight.dtype
        device = device or model.lm_head.weight.device
        self.page_size, self.num_pages, self.num_slots = page_size, num_pages, num_slots
        self.pad_slot, self.trash_page = num_slots, num_pages  # one of each past the ones handed out
        scratch = 16 * num_slots if max_step_tokens is None else max_step_tokens
        precision = model_precision(model)  # the rows' stored form (`kv_cache_dtype`)
        self.pools = {owner: [_LayerPools(s, num_pages + 1, page_size, num_slots + 1, dtype, device, scratch,
                                          precision) for s in owned] for owner, owned in specs.items()}
        self._free_slots = list(range(num_slots - 1, -1, -1))
        logger.info("paged KV cache: %d pages of %d tokens (%.1f MiB), %d sequence slots", num_pages, page_size,
                    num_pages * bytes_per_page(model, page_size, dtype, tuple(specs), precision) / 2**20, num_slots)

    @property
    def layers(self) -> list[_LayerPools]:
        """The pools of the model's main layers (the owner the batched decode path and CUDA graphs index)."""
        return self.pools.get(self.model.main_state_owner, [])

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def new_sequence(self, table: list[int], num_cached_tokens: int = 0) -> tuple[SequenceState, int]:
        """A state for a sequence whose pages are `table` (a list the caller keeps extending) and whose first
        `num_cached_tokens` (a multiple of the page size) are served from shared pages."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} sequence slots are in use")
        if num_cached_tokens % self.page_size:
            raise ValueError(f"a prefix hit must end on a page boundary, got {num_cached_tokens} tokens")
        slot = self._free_slots.pop()
        cleared: list[torch.Tensor] = []  # the slot's rings and open frontiers, zeroed together (one launch on a GPU)
        states = {owner: [p.state(slot, table, num_cached_tokens, cleared) for p in pools]
                  for owner, pools in self.pools.items()}
        torch._foreach_zero_(cleared)
        if num_cached_tokens:
            page = table[num_cached_tokens // self.page_size - 1]
            for owner, pools in self.pools.items():
                for p, st in zip(pools, states[owner]):
                    p.restore(st, page, num_cached_tokens)
        return self.model.sequence_state(states, num_cached_tokens), slot

    def free_sequence(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free_slots.append(slot)


# -- pages to and from host memory (the cache tiers: deepserve.core.kv.tiers) -----------------------------------
def page_pools(cache: PagedKVCache) -> dict[str, list[torch.Tensor]]:
    """What one page holds, as the block stores' pools: name -> the tensors indexed by page on their first axis, in
    layer order. Per state owner: `<owner>.csa` / `<owner>.hca` (compressed rows), `<owner>.index`
    (indexer keys), `<owner>.snapshot` (the page-boundary window tail and CSA overlap state)."""
    pools: dict[str, list[torch.Tensor]] = {}
    for owner, layers in cache.pools.items():
        for layer in layers:
            snapshot = pools.setdefault(f"{owner}.snapshot", [])
            snapshot.append(layer.snap_window)
            for stream, name in ((layer.compressor, None), (layer.indexer, "index")):
                if stream is None:
                    continue
                name = name or ("csa" if stream.spec.overlap else "hca")  # CSA's blocks overlap; HCA's do not
                pools.setdefault(f"{owner}.{name}", []).append(stream.rows)
                if stream.spec.overlap:
                    snapshot += [stream.snap_kv, stream.snap_gate]
    return pools


def page_pool_bytes(cache: PagedKVCache) -> dict[str, int]:
    """Bytes of one page in each pool of `page_pools`."""
    return pool_page_bytes(page_pools(cache))


def read_pages(cache: PagedKVCache, pages: Sequence[int]) -> list[dict[str, bytes]]:
    """The bytes of `pages`, one {pool: bytes} per page (a copy to host memory)."""
    return read_pool_pages(page_pools(cache), pages)


def write_pages(cache: PagedKVCache, pages: Sequence[int], blocks: Sequence[dict[str, bytes]]) -> None:
    """Put `blocks` (as `read_pages` gives them) into `pages`; a pool a block lacks is left as the page holds it
    (a store without window snapshots: the page's snapshot is then replayed)."""
    write_pool_pages(page_pools(cache), pages, blocks)


# Any paged state whose pools are tensors indexed by page on their first axis goes through these three (V4's
# `page_pools` above; V4.1's `V41PagedStates.page_pools`). The tensors of one pool share a device.
def pool_page_bytes(pools: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes of one page in each of `pools`."""
    return {name: sum(t[0].numel() * t.element_size() for t in tensors) for name, tensors in pools.items()}


def read_pool_pages(pools: dict[str, list[torch.Tensor]], pages: Sequence[int]) -> list[dict[str, bytes]]:
    """The bytes of `pages` in `pools`, one {pool: bytes} per page (a copy to host memory)."""
    if not pages:
        return []
    out: list[dict[str, bytes]] = [{} for _ in pages]
    for name, tensors in pools.items():
        index = torch.tensor(list(pages), dtype=torch.long, device=tensors[0].device)
        raw = torch.cat([t.index_select(0, index).cpu().reshape(len(pages), -1).view(torch.uint8) for t in tensors],
                        dim=1).numpy()
        for block, row in zip(out, raw):
            block[name] = row.tobytes()
    return out


def write_pool_pages(pools: dict[str, list[torch.Tensor]], pages: Sequence[int],
                     blocks: Sequence[dict[str, bytes]]) -> None:
    """Put `blocks` (as `read_pool_pages` gives them) into `pages`; a pool a block lacks is left as the page holds
    it."""
    if not pages:
        return
    sizes = pool_page_bytes(pools)
    for name, tensors in pools.items():
        have = [i for i, block in enumerate(blocks) if name in block]
        if len(have) < len(blocks):
            if have:
                write_pool_pages({name: tensors}, [pages[i] for i in have], [{name: blocks[i][name]} for i in have])
            continue
        data = b"".join(block[name] for block in blocks)
        if len(data) != sizes[name] * len(pages):
            raise ValueError(f"pool {name!r}: {len(data)} bytes for {len(pages)} pages of {sizes[name]}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(pages), -1)
        index = torch.tensor(list(pages), dtype=torch.long, device=tensors[0].device)
        offset = 0
        for t in tensors:
            width = t[0].numel() * t.element_size()
            rows = raw[:, offset:offset + width].contiguous().view(t.dtype).view(len(pages), *t.shape[1:])
            t.index_copy_(0, index, rows.to(t.device))
            offset += width
