"""V4.1's device path, checked on the CPU: `to_device` moves every weight (the loader's plain attributes, not only
the module's buffers), Engram tables placed in host memory stay there, and the dense bf16 form a `QuantWeight`
takes on a GPU computes the block-scaled GEMM's values up to rounding (the GPU tests, tests/gpu/test_v41_gpu.py,
bound the whole model against the CPU)."""

from __future__ import annotations

from pathlib import Path

import torch

from deepserve.model.v41 import load_v41
from deepserve.model.v41.moe import Expert
from deepserve.model.v41.numerics import QuantWeight

TINY = Path(__file__).parent / "golden" / "v41" / "tiny_a" / "tiny"


def weights(model):
    """(where, tensor) for every tensor the model computes with, QuantWeights' and Experts' included."""
    def tensors(v):
        if isinstance(v, (list, tuple)):
            return [t for item in v for t in tensors(item)]
        if isinstance(v, Expert):
            return tensors([v.w1, v.w2, v.w3])
        if isinstance(v, QuantWeight):
            return [v.dense if v.dense is not None else v.values]
        return [v] if isinstance(v, torch.Tensor) else []

    for mod_name, module in model.named_modules():
        attrs = [(n, v) for n, v in vars(module).items() if not n.startswith("_")]
        for name, value in attrs + list(module.named_buffers(recurse=False)):
            for t in tensors(value):
                yield f"{mod_name}.{name}", t


def test_to_device_moves_every_weight_and_leaves_placed_engram_tables():
    model = load_v41(TINY, engram_device="cpu")
    before = sum(1 for _ in weights(model))
    model.to_device("meta")
    left = [(where, w.device.type) for where, w in weights(model) if w.device.type != "meta"]
    assert {where.rsplit(".", 1)[0] for where, _ in left} == {"layers.1.engram.table", "layers.2.engram.table"}
    assert sum(1 for _ in weights(model)) == before
    wq_a = model.layers[0].attn.wq_a
    assert wq_a.values is None and wq_a.dense.dtype == torch.bfloat16 and wq_a.dense.device.type == "meta"


def test_the_dense_form_computes_the_block_gemm_up_to_rounding():
    torch.manual_seed(0)
    model = load_v41(TINY)
    for w in (model.layers[0].attn.wq_b, model.layers[0].ffn.experts[0].w1, model.layers[0].ffn.shared.w2):
        x = torch.randn(5, w.values.shape[1], dtype=torch.bfloat16)
        block = w(x).float()
        dense = QuantWeight(w.kind, None, None, w.dequantized().to(torch.bfloat16))(x).float()
        assert torch.equal(w.dequantized().to(torch.bfloat16).float(), w.dequantized())  # exact in bf16
        rel = (dense - block).norm() / block.norm()
        assert rel < 1e-2, rel  # bf16 output rounding, in another order of additions


def test_sequences_attended_together_match_each_alone():
    """The device path's batched decode attention (`model._attend_together`: the sequences' keys side by side,
    one sparse attention) computes, on the CPU, each sequence's own attention up to rounding."""
    from deepserve.model.v41.attention import Shared
    from deepserve.model.v41.model import _attend_together

    torch.set_num_threads(1)
    model = load_v41(TINY)
    g = torch.Generator().manual_seed(2)
    states = [model.make_state() for _ in range(3)]
    for st, n in zip(states, (6, 40, 90)):
        model.forward(torch.randint(3, 500, (n,), generator=g).tolist(), st)
    attn, j = model.layers[4].attn, 4  # the ratio-1 kv source: window and compressed picks
    x = torch.randn(3, model.cfg.dim, generator=g).to(torch.bfloat16)
    qr, q_lin, kv_lin = attn.project_in(x, apart=True)
    rows = lambda sts: [(x[i : i + 1], qr[i : i + 1], q_lin[i : i + 1], kv_lin[i : i + 1], st.num_tokens,
                         st.layers[j], st, Shared()) for i, st in enumerate(sts)]
    copies = [model.make_state() for _ in states]
    for c, st in zip(copies, states):
        c.load(st.save())
    alone = torch.cat([attn.attend(*r) for r in rows(states)]).float()
    together = _attend_together(attn, [attn.gather_keys(*r) for r in rows(copies)]).float()
    assert together.shape == alone.shape == (3, model.cfg.n_heads, model.cfg.head_dim)
    assert (together - alone).abs().max() <= 0.02 * alone.abs().max()
