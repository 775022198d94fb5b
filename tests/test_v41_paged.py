"""V4.1's paged state (`deepserve.model.v41.paged`): every role over pages and slots computes what the
contiguous state does, bit for bit; the rows live in the table's pages; a sequence restored from a page's
snapshot (a prefix hit) holds what the first one held there and continues alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepserve.model.v41 import load_v41
from deepserve.model.v41.paged import V41PagedStates, bytes_per_page

GOLDEN = Path(__file__).parent / "golden" / "v41"
PAGE = 128


@pytest.fixture(scope="module", params=["tiny_a", "tiny_b"])  # tiny_b: two ratio-1 Reindex layers
def model(request):
    torch.set_num_threads(1)
    return load_v41(GOLDEN / request.param / "tiny")


def run(model, state, ids, steps):
    """A prompt in two chunks, then one-token decode steps; the logits of every position."""
    out = [model.forward(ids[:100], state, all_logits=True, prompt=True).logits,
           model.forward(ids[100:140], state, all_logits=True, prompt=True).logits]
    out += [model.forward([t], state).logits.unsqueeze(0) for t in steps]
    return torch.cat(out)


def test_every_role_in_pages_computes_the_contiguous_state(model):
    owners = model.state_owners()
    assert {s.role for s in owners["layers"]} >= {"window", "full", "reuse", "reindex"}
    states = V41PagedStates(owners, num_slots=2, num_pages=6, page_size=PAGE)
    ids = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    table = [4, 1]  # pages out of order: rows are found through the table
    paged, slot = states.new_sequence(table)
    contiguous = model.make_state()
    assert torch.equal(run(model, paged, ids, ids[140:]), run(model, contiguous, ids, ids[140:]))
    for p, c in zip(paged.layers, contiguous.layers):
        assert torch.equal(p.ring, c.ring)
        if c.rows is not None:
            assert torch.equal(p.rows, c.rows)
            per_page = PAGE // c.spec.ratio  # the first page's rows sit in page 4
            assert torch.equal(states.layers[c.spec.layer].rows[4], c.rows[:per_page])
        if c.index_keys is not None:
            assert torch.equal(p.index_keys, c.index_keys)
    assert paged.engram_history == contiguous.engram_history
    assert paged.index_key_publisher == contiguous.index_key_publisher
    states.free_sequence(slot)
    assert states.num_free_slots == 2


def test_a_sequence_restored_from_a_page_snapshot_continues_alike(model):
    owners = model.state_owners()
    states = V41PagedStates(owners, num_slots=3, num_pages=6, page_size=PAGE)
    ids = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    first, _ = states.new_sequence([2, 5])
    model.forward(ids[:PAGE], first, prompt=True)
    states.snapshot(2, first)
    tail_first = model.forward(ids[PAGE:], first, all_logits=True, prompt=True).logits
    second, _ = states.new_sequence([2, 3], num_cached_tokens=PAGE)  # shares page 2, its own page 3
    assert second.num_tokens == PAGE and second.layers[2].rows.shape[0] == PAGE // 2
    run_tail = model.forward(ids[PAGE:], second, all_logits=True, prompt=True).logits
    assert torch.equal(run_tail, tail_first)
    with pytest.raises(RuntimeError, match="page 5 holds no V4.1 snapshot at token 128"):
        states.new_sequence([5], num_cached_tokens=PAGE)
    states.new_sequence([1])
    with pytest.raises(RuntimeError, match="all 3 V4.1 sequence slots are in use"):
        states.new_sequence([0])


def test_a_page_costs_its_rows_and_its_snapshot(model):
    c = model.cfg
    rows = sum(PAGE // c.compress_ratios[j] * 2 * (c.head_dim + (c.index_head_dim if j in c.index_source_layers
                                                                else 0)) for j in c.kv_source_layers)
    rings = (c.n_layers + c.n_mtp_layers) * c.window_size * c.head_dim * 2
    opens = sum(2 * 2 * c.head_dim * 4 for j in c.kv_source_layers if c.compress_ratios[j] == 2)
    assert bytes_per_page(model.state_owners(), PAGE) == rows + rings + opens
