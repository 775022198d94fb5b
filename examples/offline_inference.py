"""Offline batched generation with deepserve's vLLM-style API.

    DEEPSERVE_MODEL=/path/to/DeepSeek-V4-checkpoint python examples/offline_inference.py

`DEEPINFER_HF_MODEL_DIR` works too (DeepInfer's name), and `DEEPSERVE_ACCELERATOR` / `DEEPINFER_ACCELERATOR`
(`cpu|nvidia|ascend`) force a backend. With no model named it runs the embedded default model that ships inside
the package (a tiny V4 trained on Python's standard library); without that, it builds a small random checkpoint.
"""

import tempfile

from deepserve import LLM, SamplingParams
from deepserve.core.env import default_model_dir

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n",
    "DeepSeek-V4 compresses its KV cache by",
]


def main() -> None:
    model_dir = default_model_dir()
    if model_dir is None:
        from deepserve.tools.demo_checkpoint import build_demo_checkpoint

        model_dir = str(build_demo_checkpoint(tempfile.mkdtemp(prefix="deepserve-demo-")))
        print(f"no model named and no embedded model: built a random demo checkpoint in {model_dir}")
    llm = LLM(model=model_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=1234)
    for title, params in (("greedy", greedy), ("sampled (seed 1234)", sampled)):
        print(f"\n=== {title} ===")
        for out in llm.generate(PROMPTS, params):
            completion = out.outputs[0]
            print(f"{out.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")


if __name__ == "__main__":
    main()
