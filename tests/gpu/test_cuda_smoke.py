"""On an NVIDIA GPU: the reference ops through NvidiaBackend give the CPU's results (fp32) and run in bf16."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo-gpu"), seed=1)


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in (5, 70, 130)]


def test_cuda_fp32_matches_cpu(demo_dir):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    cpu = LLM(demo_dir, dtype="float32", accelerator="cpu").generate(prompts(), params, use_tqdm=False)
    gpu_llm = LLM(demo_dir, dtype="float32", accelerator="nvidia")
    assert gpu_llm.backend.name == "nvidia" and gpu_llm.model.lm_head.weight.is_cuda
    gpu = gpu_llm.generate(prompts(), params, use_tqdm=False)
    worst = 0.0
    for a, b in zip(cpu, gpu):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (ta, la), = pa.items()
            worst = max(worst, abs(la.logprob - pb[ta].logprob))
    assert worst < 1e-3, worst
    assert sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(cpu, gpu)) >= 2


def test_cuda_bf16_generates(demo_dir):
    llm = LLM(demo_dir, dtype="auto", accelerator="nvidia")
    assert llm.model.lm_head.weight.dtype == torch.bfloat16
    outs = llm.generate(prompts(), SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)


def test_to_device_with_the_stream_idle_and_busy():
    """`batch.to_device` copies blocking when the stream is idle and asynchronously behind queued work: the same
    values and dtype either way, read back after the work they queued behind."""
    from deepserve.model.batch import to_device

    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    idle = to_device([1, 2, 3], torch.long, "cuda")
    for _ in range(20):
        a = a @ a / 64
    busy = to_device([[4, 5], [6, 7]], torch.int32, "cuda")
    assert idle.tolist() == [1, 2, 3] and idle.dtype == torch.long
    assert busy.tolist() == [[4, 5], [6, 7]] and busy.dtype == torch.int32
