"""On an NVIDIA GPU: speculative decoding runs on the device with the embedded model (Triton kernels, bf16): it
drafts, keeps drafts, completes greedy and sampled requests and frees every page. (Token identity with plain
decoding is tested on the CPU, where the ops are batch-invariant.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import deepserve
from deepserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
PROMPTS = ["import os\nimport sys\n", "def add(a, b):\n", "class Stack:\n    def __init__(self):\n"]


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_speculative_on_cuda(method):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = LLM(EMBEDDED, dtype="bfloat16", accelerator="nvidia", load_plugins=False,
               speculative_config={"method": method, "num_speculative_tokens": 5})
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert sum(o.num_accepted_tokens for o in outs) > 0
    sampled = spec.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in sampled)
    assert spec.kv_manager.num_free_blocks == spec.kv_manager.pool.num_blocks

