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
