"""On an NVIDIA GPU: `batch_invariant=True` keeps a request's bits whatever shares its steps (the kernels with fixed
tiles and reduction orders, `NvidiaBackend(invariant=True)`), and its GEMM gives a row the same bits at any row count.
The CPU runs the same checks under Triton's interpreter (tests/test_nvidia_interpreted.py); here the kernels are
compiled, on tensor cores, at the demo model's shapes and at a V4-Flash projection's."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo-invariant"), seed=3)


def _bits(llm, prompts):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def test_a_requests_bits_alone_batched_and_chunked(demo_dir):
    g = torch.Generator().manual_seed(0)
    a = torch.randint(2, 258, (150,), generator=g).tolist()
    others = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (7, 40, 90, 200, 33, 64, 120)]
    llm = LLM(demo_dir, dtype="bfloat16", accelerator="nvidia", batch_invariant=True, enable_prefix_caching=False)
    assert llm.backend.invariant and not llm.backend.cuda_graphs
    alone = _bits(llm, [a])
    assert _bits(llm, [a] + others) == alone
    assert _bits(llm, [a] + others[:3]) == alone
    chunked = LLM(demo_dir, dtype="bfloat16", accelerator="nvidia", batch_invariant=True,
                  enable_prefix_caching=False, max_num_batched_tokens=32)
    assert _bits(chunked, [a] + others) == alone
    assert _bits(llm, [a]) == alone  # and again, after the engine's cost model has refitted


@pytest.mark.parametrize("K,N", [(64, 512), (4096, 1024), (7168, 4096)])
def test_the_invariant_gemm_gives_a_row_the_same_bits_at_any_row_count(K, N):
    from deepserve.backends.nvidia.triton_ops.invariant import matmul

    g = torch.Generator(device="cuda").manual_seed(K)
    x = torch.randn((300, K), generator=g, device="cuda").bfloat16()
    w = (torch.randn((N, K), generator=g, device="cuda") * K**-0.5).bfloat16()
    full = matmul(x, w)
    ref = x.float() @ w.float().t()
    assert ((full.float() - ref).norm() / ref.norm()).item() < 1e-2
    for m in (1, 2, 5, 16, 63, 64, 65, 129):
        assert torch.equal(matmul(x[:m], w), full[:m]), m
    assert torch.equal(matmul(x[:7], w, torch.float32), matmul(x, w, torch.float32)[:7])
