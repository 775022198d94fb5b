"""The model registry: config `model_type` -> the model class that serves it."""

from __future__ import annotations

import pytest

from deepserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from deepserve.model.registry import model_class, register_model


def test_the_model_registry_serves_v4_and_refuses_unknown_types():
    assert model_class("deepseek_v4") is DeepseekV4ForCausalLM and model_class(None) is DeepseekV4ForCausalLM
    with pytest.raises(ValueError, match="deepseek_v9.*deepseek_v4"):
        model_class("deepseek_v9")
    with pytest.raises(ValueError, match="already served"):
        register_model("deepseek_v4", "elsewhere", "Other")
