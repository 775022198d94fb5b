"""The reference backend is batch-invariant by construction: a row's result has the same bits alone, at any
position of any batch, and with any padding, on any CPU. The batch sizes here cross the row counts where BLAS
libraries switch GEMM kernels (1, 4, 8, 16, ... on AVX-512 Xeons), and the widths cross the vector sizes where
vectorised loops switch from their body to their tail.

The fingerprint test pins the exact primitives' bits on inputs that every machine builds alike (integers over
powers of two): a CPU or torch version whose kernels leaked into the results would change the digest.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.backends.reference import exact

BATCHES = (1, 2, 3, 5, 8, 13, 16, 31, 64, 70)


def exact_inputs(shape, seed: int, scale_bits: int = 6) -> torch.Tensor:
    """Values m / 2^scale_bits for integers m: the same tensor on every machine (torch's randn is vectorised
    per instruction set, randint is not)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 9), 1 << 9, shape, generator=g).float() / (1 << scale_bits)


def rows_alone_and_batched(op, rows: torch.Tensor, *extra):
    """op on each batch size's leading rows equals op on each row alone, bit for bit."""
    alone = [op(rows[i : i + 1], *extra) for i in range(max(BATCHES))]
    for size in BATCHES:
        batched = op(rows[:size], *extra)
        for i in (0, size // 2, size - 1):
            assert torch.equal(batched[i : i + 1], alone[i]), f"row {i} of a batch of {size}"


@pytest.fixture(scope="module")
def ref():
    return ReferenceBackend("cpu")


@pytest.mark.parametrize("k,n", [(7, 5), (64, 96), (128, 4096), (1024, 24)])
def test_linear_rows_do_not_depend_on_the_batch(ref, k, n):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    rows_alone_and_batched(ref.linear, torch.randn(max(BATCHES), k) * 3, weight)


def test_grouped_linear_and_stacked_expert_views(ref):
    weight = torch.randn(2, 48, 64)
    rows_alone_and_batched(ref.grouped_linear, torch.randn(max(BATCHES), 2, 64), weight)
    stacked = torch.randn(4, 32, 64)  # one expert of a stacked weight is served from the stack's slices
    x = torch.randn(9, 64)
    assert torch.equal(ref.linear(x, stacked[2]), ref.linear(x, stacked[2].clone()))


def test_a_weight_written_in_place_is_sliced_again(ref):
    weight, x = torch.randn(16, 32), torch.randn(3, 32)
    before = ref.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2)
    assert torch.equal(ref.linear(x, weight), before * 2)


def test_norms_rope_and_activations_do_not_depend_on_the_batch(ref):
    rows = torch.randn(max(BATCHES), 4, 96)
    norm_weight = torch.rand(96) + 0.5
    rows_alone_and_batched(lambda x: ref.rms_norm(x, norm_weight, 1e-6), rows)
    positions = torch.randint(0, 60000, (max(BATCHES),))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)
    alone = [ref.apply_rope(rows[i : i + 1], positions[i : i + 1], inv_freq) for i in range(max(BATCHES))]
    for size in BATCHES:
        batched = ref.apply_rope(rows[:size], positions[:size], inv_freq)
        assert all(torch.equal(batched[i : i + 1], alone[i]) for i in range(size))
    gate, up = torch.randn(max(BATCHES), 37) * 4, torch.randn(max(BATCHES), 37)
    rows_alone_and_batched(lambda g, u: ref.swiglu(g, u, 10.0), gate, up[: 1])  # broadcast up: shape only
    rows_alone_and_batched(ref.router_scores, torch.randn(max(BATCHES), 19) * 5)


def test_mhc_sites_do_not_depend_on_the_batch(ref):
    n, d = 4, 40
    streams = torch.randn(max(BATCHES), n, d)
    fn, base = torch.randn(n * (2 + n), n * d) * 0.1, torch.randn(n * (2 + n))
    scale = torch.tensor([0.5, 0.7, 0.9])
    rows_alone_and_batched(lambda s: torch.cat([t.flatten(1) for t in ref.hc_pre(s, fn, base, scale, 20, 1e-6,
                                                                                 1e-6)], 1), streams)
    rows_alone_and_batched(lambda s: ref.hc_head(s, fn[:n], base[:n], scale[:1], 1e-6, 1e-6), streams)


def test_attention_ignores_padding_and_the_batch(ref):
    H, d, N, T = 4, 32, 50, max(BATCHES)
    q, kv, sinks = torch.randn(T, H, d), torch.randn(N, d), torch.randn(H)
    g = torch.Generator().manual_seed(3)
    lists = [torch.randperm(N, generator=g)[: int(w)].sort().values for w in torch.randint(1, 40, (T,), generator=g)]

    def padded(ids, width):
        return torch.cat((ids, ids.new_full((width - ids.numel(),), -1)))

    alone = [ref.sparse_attention(q[i : i + 1], kv, lists[i][None], sinks, 0.2) for i in range(T)]
    for size in BATCHES:
        width = max(lst.numel() for lst in lists[:size]) + 7  # padded past the longest list
        indices = torch.stack([padded(lst, width) for lst in lists[:size]])
        out = ref.sparse_attention(q[:size], kv, indices, sinks, 0.2)
        assert all(torch.equal(out[i : i + 1], alone[i]) for i in range(size)), size


def test_indexer_and_pooling_do_not_depend_on_the_batch(ref):
    T, Hi, Di, N = max(BATCHES), 8, 16, 90
    q, w, keys = torch.randn(T, Hi, Di), torch.randn(T, Hi), torch.randn(N, Di)
    start = torch.randint(0, 30, (T,))
    count = torch.randint(1, 60, (T,))
    alone = [ref.indexer_topk(q[i : i + 1], w[i : i + 1], keys, start[i : i + 1], count[i : i + 1], 6)
             for i in range(T)]
    for size in BATCHES:
        out = ref.indexer_topk(q[:size], w[:size], keys, start[:size], count[:size], 6)
        assert all(torch.equal(out[i : i + 1], alone[i]) for i in range(size)), size
    gates = torch.randn(T, 8, 24)
    gates[:, :4] = float("-inf")  # a block without a predecessor drops its first slots
    rows_alone_and_batched(lambda g: ref.softmax_pool(torch.ones_like(g) * 3 + g.nan_to_num(0, 0, 0), g), gates)


def test_torch_mode_computes_the_same_formulas(ref):
    plain = ReferenceBackend("cpu", exact=False)
    x, weight = torch.randn(6, 64), torch.randn(32, 64)
    assert torch.allclose(plain.linear(x, weight), ref.linear(x, weight), atol=1e-5)
    assert torch.allclose(plain.rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6), atol=1e-6)
    gates = torch.randn(5, 8, 12)
    assert torch.allclose(plain.softmax_pool(x[:5, :12, None].expand(5, 12, 8).transpose(1, 2), gates),
                          ref.softmax_pool(x[:5, :12, None].expand(5, 12, 8).transpose(1, 2), gates), atol=1e-6)


def test_exact_primitives_are_accurate():
    x = torch.linspace(-80, 80, 20001, dtype=torch.float64)
    assert torch.allclose(exact.exp(x), torch.exp(x), rtol=4e-15, atol=0)
    assert torch.allclose(exact.log(x.abs() + 1e-3), torch.log(x.abs() + 1e-3), rtol=4e-15, atol=4e-16)
    sin, cos = exact.sincos(x * 1000)
    assert (sin - torch.sin(x * 1000)).abs().max() < 1e-12 and (cos - torch.cos(x * 1000)).abs().max() < 1e-12
    assert torch.allclose(exact.softplus(x), torch.nn.functional.softplus(x, threshold=50), rtol=1e-15)
    a, b = torch.randn(33, 300), torch.randn(300, 17)
    assert torch.allclose(exact.matmul(a, b), a.double() @ b.double(), rtol=0, atol=1e-7)
    assert exact.exp(torch.tensor([-math.inf])).float().item() == 0.0
    assert math.isnan(exact.exp(torch.tensor([math.nan])).item())


def test_exact_primitives_give_the_same_bits_on_every_machine():
    a, b = exact_inputs((37, 300), 1), exact_inputs((300, 29), 2, scale_bits=9)
    angles = exact_inputs((4096,), 3, scale_bits=0) * 37.0
    digest = hashlib.sha256()
    for t in (exact.matmul(a, b), exact.grid_sum(a * a, -1), exact.softmax(a / 8, -1), exact.silu(a),
              exact.softplus(a), *exact.sincos(angles), exact.log(a.abs() + 1)):
        digest.update(t.float().numpy().tobytes())
    assert digest.hexdigest() == EXPECTED_DIGEST


EXPECTED_DIGEST = "7eea52de1a630ac4a9bb8b0da4705caffbf8f31d1c5f65e4f2ba2763a70dd40c"


def test_batch_invariant_option_picks_the_mode(monkeypatch):
    from deepserve.build import resolve_config
    from deepserve.core.config import EngineConfig
    from deepserve.core.plugins import make_plugin_manager, select_backend

    pm = make_plugin_manager(load_entrypoints=False)
    assert select_backend(pm, EngineConfig(accelerator="cpu")).exact  # the CPU default: exact
    assert not select_backend(pm, EngineConfig(accelerator="cpu", batch_invariant=False)).exact
    monkeypatch.setenv("DEEPSERVE_BATCH_INVARIANT", "0")
    assert resolve_config("somewhere").batch_invariant is False
    assert resolve_config("somewhere", batch_invariant=True).batch_invariant is True  # the option wins
    monkeypatch.setenv("DEEPSERVE_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="DEEPSERVE_BATCH_INVARIANT must be 0 or 1"):
        resolve_config("somewhere")
