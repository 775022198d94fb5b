"""Write a model as a Hugging Face-style checkpoint directory (config.json + model.safetensors), with plain
weights or in DeepSeek's stored form (FP8 dense projections, FP4 routed experts)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepserve.core.config import model_config_to_hf_dict

from .deepseek_v4 import DeepseekV4ForCausalLM
from .quant import FP8_BLOCK, QuantScheme, quantize_stored, scale_name

_STACKED_EXPERTS = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def quantization_config(scheme: QuantScheme) -> dict:
    """The `quantization_config` of a checkpoint stored in `scheme`, as DeepSeek's release and vLLM spell it."""
    return {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
            "weight_block_size": list(scheme.weight_block), "expert_dtype": scheme.expert_format}


def save_checkpoint(model: DeepseekV4ForCausalLM, path: str | os.PathLike, quantization: str = "none",
                    scheme: QuantScheme | None = None) -> Path:
    """Tensors under their canonical (HF in-memory) names, which transformers and deepserve both load.

    `quantization="fp8"`: plain weights that DeepSeek stores quantized are written as FP8 / FP4 with e8m0 scales
    (`<name>_scale_inv`) in `scheme`'s blocks (default: 128x128, FP4 experts), routed experts one tensor per
    expert and projection as the release has them, and config.json gets the `quantization_config`. Weights the
    model already keeps as stored are written as they are, in either mode."""
    if quantization not in ("none", "fp8"):
        raise ValueError(f"quantization must be 'none' or 'fp8', got {quantization!r}")
    scheme = scheme or QuantScheme((FP8_BLOCK, FP8_BLOCK), "fp4")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # copies: projections that share an input are views into one stacked weight (`common.SharedInput`);
    # quantized where the weights are (a GPU quantizes a full-depth model in seconds), then copied to the host
    live = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in live.items():
        quantized = None
        if quantization == "fp8" and scale_name(name) not in live:
            quantized = quantize_stored(name, tensor.detach(), scheme)
        if quantized is None:
            state[name] = tensor.detach().to("cpu", copy=True).contiguous()
        else:
            state[name], state[scale_name(name)] = (t.to("cpu", copy=True).contiguous() for t in quantized)
    stored = any(name.endswith("_scale_inv") for name in state)
    state = _split_stored_experts(state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model_config_to_hf_dict(model.cfg)
    config["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    if stored:
        config["quantization_config"] = quantization_config(scheme)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _split_stored_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored routed-expert stacks -> per-expert `experts.{e}.w1/w3/w2.weight` and their scales (w1 rows, then w3
    rows, as `weight_names.ExpertStacker` stacks them back)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _STACKED_EXPERTS.match(name.removesuffix("_scale_inv"))
        if match is None or scale_name(match.group(0)) not in state:
            out[name] = tensor
            continue
        prefix, leaf = match.groups()
        suffix = ".weight_scale_inv" if name.endswith("_scale_inv") else ".weight"
        for e, rows in enumerate(tensor):
            if leaf == "down_proj":
                out[f"{prefix}.{e}.w2{suffix}"] = rows.clone()
            else:
                half = rows.shape[0] // 2
                out[f"{prefix}.{e}.w1{suffix}"], out[f"{prefix}.{e}.w3{suffix}"] = rows[:half].clone(), rows[half:].clone()
    return out
