"""Shared fixtures: one thread for torch, and tiny oracle checkpoints built with transformers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
# The suite builds hundreds of engines in one process: each would collect and freeze the whole heap (pytest's
# included) and unfreeze it at shutdown. tests/test_gc_freeze.py checks the freeze with the variable unset.
os.environ.setdefault("DEEPSERVE_GC_FREEZE", "0")


def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))


@pytest.fixture(scope="session")
def hf_tiny():
    """transformers' DeepseekV4ForCausalLM with every layer type, random non-default weights, fp32."""
    import tiny

    return tiny.make_hf_model(seed=0)


@pytest.fixture(scope="session")
def tiny_dir(hf_tiny, tmp_path_factory) -> Path:
    """`hf_tiny` saved with `save_pretrained` (HF's hybrid key spelling)."""
    import tiny

    return tiny.save_hf_checkpoint(hf_tiny, tmp_path_factory.mktemp("tiny-v4"))
