"""Where one forward's sequences keep their attention state: the execution layout a layer's one forward runs over.

The layers (`attention.Attention`, `compressor.Compressor`, `compressor.Indexer`) compute the model's maths once;
what differs between a test's own states, the engine's paged cache and a CUDA-graph decode step is only where the
keys and compressed rows live and how new ones are written. A *step layout* stands for that, per forward:

| layout | states | chosen when |
| --- | --- | --- |
| `ContiguousStep` (`contiguous.py`) | each sequence's own window ring and growing row stores | states made by `make_state` (tests, training), or a step the paged path cannot take |
| `PagedStep` (`paged.py`) | the paged cache's pools, indexed in place, a constant number of launches | every state of the step in one `PagedKVCache` and the step's new rows fit its scratch region |
| `StaticStep` (`static.py`) | the same pools, shapes fixed by a bucket, no host-side chunks | a fixed-shape decode step (`cuda_graphs.DecodeGraphs` builds it) |

`layout_for` picks between the first two from the states; the decode graphs build the static one themselves.
Each step layout gives one `LayerLayout` per layer (`layer(i)`), which the layer calls at fixed points:

1. `emit(pooler, kv, gate, stream)`: a compressor's raw projections [T, F] of the step's tokens into its stream
   (`"compressor"` or `"indexer"`): frontier bookkeeping, and every block they close pooled into a row
   (`_Pooler.rows`, the maths).
2. `index_scored(indexer)`, `index_topk(indexer, q, weights)`, `all_visible(pooler, stream)`: the compressed rows
   each query attends to, numbered within its sequence (-1 = none): the indexer's top-k, or every row it may see.
3. `keys(kv, compressed)` -> (pool, indices): the key rows [N, d] and each query's index list [T, W + K] for the
   backend's `sparse_attention` (its window keys, this step's new keys `kv` included, then its compressed rows).
4. `store_window(kv)`: after the attention read, the step's keys into the window rings (and the page-boundary
   window snapshots that prefix hits restore).

Every layout gives the same keys in the same order for the same tokens, so the same bits (tests/
test_decode_fast_path.py, test_cuda_graphs.py, test_speculative_rollback.py hold the layouts to that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..batch import ForwardBatch
from ..state import AttentionState
from .base import LayerLayout, StepLayout
from .contiguous import ContiguousStep
from .paged import PagedStep, paged_step_pools
from .static import StaticDecode, StaticStep

# The batched paged layout is taken whenever `paged_step_pools` allows it; False sends every step down the
# contiguous (per-sequence) layout (tests and bench/investigations/decode_host.py compare the two).
PAGED = True


def layout_for(batch: ForwardBatch, layer_states: Sequence[Sequence[AttentionState]], backend,
               dtype: torch.dtype | None = None) -> StepLayout:
    """The layout of a step over `layer_states[s][i]` (sequence s, layer i, one state owner's layers): paged when
    every state of it lives in one paged cache whose rows decode to `dtype` (the activations') and whose scratch
    region holds the step's new rows, else contiguous."""
    if PAGED and layer_states and layer_states[0]:
        pools = paged_step_pools(batch, [states[0] for states in layer_states])
        if pools is not None and (dtype is None or pools.dtype == dtype):
            return PagedStep(batch, layer_states, backend)
    return ContiguousStep(batch, layer_states, backend)


__all__ = ["ContiguousStep", "LayerLayout", "PagedStep", "StaticDecode", "StaticStep", "StepLayout", "layout_for"]
