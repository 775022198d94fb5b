"""Which model class serves a checkpoint, by its config's `model_type` (vLLM's `ModelRegistry`).

A new architecture (V4.1's `deepseek_v41`) arrives as one `register_model` call naming its module and class;
the module is imported only when a checkpoint of that type is loaded.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

_MODELS: dict[str, tuple[str, str]] = {
    "deepseek_v4": ("deepserve.model.deepseek_v4", "DeepseekV4ForCausalLM"),
    "deepseek_v41": ("deepserve.model.v41", "DeepseekV41ForCausalLM"),
}


def register_model(model_type: str, module: str, class_name: str) -> None:
    """Serve checkpoints whose config says `model_type` with `module.class_name`, a class built as
    `cls(cfg: ModelConfig, backend: Backend)`. Registering a type twice is an error (two plugins disagree)."""
    if model_type in _MODELS and _MODELS[model_type] != (module, class_name):
        raise ValueError(f"model_type {model_type!r} is already served by {'.'.join(_MODELS[model_type])}")
    _MODELS[model_type] = (module, class_name)


def model_types() -> list[str]:
    return sorted(_MODELS)


def model_class(model_type: str | None) -> type:
    """The class registered for `model_type` (None: a config without one, read as V4's)."""
    key = model_type or "deepseek_v4"
    if key not in _MODELS:
        raise ValueError(f"no model is registered for model_type {key!r}; registered: {model_types()}")
    module, name = _MODELS[key]
    return getattr(importlib.import_module(module), name)


def checkpoint_model_type(model_dir) -> str | None:
    """The `model_type` a checkpoint directory's `config.json` names (None: no config.json, or none named)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a JSON object: {exc}") from exc
