"""Write a model as a Hugging Face-style checkpoint directory (config.json + model.safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from deepserve.core.config import model_config_to_hf_dict

from .deepseek_v4 import DeepseekV4ForCausalLM


def save_checkpoint(model: DeepseekV4ForCausalLM, path: str | os.PathLike) -> Path:
    """Tensors under their canonical (HF in-memory) names, which transformers and deepserve both load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # copies: projections that share an input are views into one stacked weight (`common.SharedInput`)
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model_config_to_hf_dict(model.cfg)
    config["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
