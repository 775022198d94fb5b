"""Builders for tiny random DeepSeek-V4 checkpoints made with transformers' `DeepseekV4ForCausalLM` (the oracle).

The default shape shrinks the window to 16 and the HCA ratio to 16 (spec section 6) so that prompts of ~80
tokens cover window wrap, CSA overlap, HCA emission and real top-k sparsity (16 indexer heads, top-4).
Weights are re-drawn with fan-in scaling and non-default sinks, position biases, router biases and tid2eid
permutations, so that no part of the model is a no-op.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

LAYERS = [
    "sliding_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]


def tiny_config_dict(**overrides) -> dict:
    cfg = dict(
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=len(LAYERS),
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        layer_types=list(LAYERS),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=4,
        partial_rotary_factor=0.5,
        max_position_embeddings=65536,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg.update(overrides)
    cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter and buffer a non-trivial value (fan-in scaled weights, random sinks and biases)."""
    g = torch.Generator().manual_seed(seed)

    def randn(shape, std):
        return torch.randn(shape, generator=g) * std

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1.0 + randn(p.shape, 0.1))
        elif leaf == "sinks":
            p.copy_(randn(p.shape, 1.0))
        elif leaf == "position_bias":
            p.copy_(randn(p.shape, 0.5))
        elif leaf in ("fn", "hc_fn"):
            p.copy_(randn(p.shape, 0.5 / math.sqrt(p.shape[-1])))
        elif leaf in ("base", "hc_base"):
            p.copy_(randn(p.shape, 0.5))
        elif leaf in ("scale", "hc_scale"):
            p.copy_(1.0 + randn(p.shape, 0.2))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(randn(p.shape, 1.0))
        else:  # linear / expert weights [..., out, in]
            p.copy_(randn(p.shape, 1.0 / math.sqrt(p.shape[-1])))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(randn(b.shape, 0.1))
        elif name.endswith("tid2eid"):
            n_experts = model.config.n_routed_experts
            rows = [torch.randperm(n_experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]
            b.copy_(torch.stack(rows))


def make_hf_model(seed: int = 0, **overrides):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**tiny_config_dict(**overrides))
    model = DeepseekV4ForCausalLM(config).float().eval()
    randomize_(model, seed)
    return model


def save_hf_checkpoint(model, path: Path) -> Path:
    """`save_pretrained` into `path` (HF's hybrid spelling, section 5.4 of the spec) and return it."""
    path = Path(path)
    model.save_pretrained(path)
    return path


def config_json(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def demo_model(tmp_path_factory, seed: int):
    """deepserve's demo architecture (window 16, CSA ratio 4 with overlap and indexer, HCA ratio 16; random
    weights from `seed`), written by `build_demo_checkpoint` and loaded in fp32 on the CPU reference backend."""
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.factory import load_model
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path_factory.mktemp(f"demo-{seed}"), seed=seed)
    return load_model(path, ReferenceBackend("cpu"), dtype="float32", progress=False)
