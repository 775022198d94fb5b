"""The NVIDIA backend through the engine, its Triton kernels included, on the CPU under Triton's interpreter
(`LLM(accelerator="nvidia", device="cpu")` with TRITON_INTERPRET=1): the paths the GPU runs, checked where CI runs.

- No stale reads: a request's bits are the same on fresh pools and on pools filled with NaN (every floating tensor
  the KV cache holds), in the eager (paged) layout and in the static one that CUDA graphs capture: no kernel reads
  a row the request did not write.
- The batch-invariant mode (`batch_invariant=True`: fixed tiles, one part per attention query, the lowest rows on
  indexer ties, the experts added in routing order, the reference's exact ops for the rest) gives a request the
  same bits alone, beside two others and with its prompt cut into 16-token chunks; the default mode does not
  (checked too, so the comparison can fail: the interpreter's numpy products are invariant only where the tiles
  are fixed, as the GPU's are).
- Both modes compute the model: the prefill's greedy token and its logprob are the reference backend's (the
  interpreter's bf16 products widened to fp32, as tensor cores multiply them); with weights kept as stored (FP8
  projections, FP4 experts) the prompt's token and a decode step's, with their logprobs, through the stored
  kernels (the FP4 experts' grouped path, the shared expert fused with a decode step's pairs), and the invariant
  mode's bits beside two other requests.

The interpreter must be chosen before triton is first imported, so the checks run in one child process (this file
run as a script) and each test reads its result. Skipped where triton is not installed or a GPU is present (there
the kernels run for real: tests/gpu/).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

import pytest
import torch

from interpreted import child_main, run_child

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (scripts/bootstrap.sh installs it for its interpreter)",
                allow_module_level=True)

# past the window (16) and an HCA block (16); its decode steps close a CSA block (ratio 4) at position 23
PROMPT = [(7 * j) % 200 + 2 for j in range(22)]
OTHERS = [[(11 * j + i) % 200 + 2 for j in range(9 + 7 * i)] for i in range(2)]


def _llm(path, **kw):
    from deepserve import LLM

    return LLM(model=str(path), accelerator="nvidia", device="cpu", dtype="bfloat16", max_num_seqs=4,
               max_model_len=256, enable_prefix_caching=False, **kw)


def _bits(llm, prompts, tokens: int = 3) -> tuple[list[int], list[float]]:
    from deepserve import SamplingParams

    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    first = outs[0].outputs[0]
    return list(first.token_ids), [lp[t].logprob for lp, t in zip(first.logprobs, first.token_ids)]


def _poison(cache) -> int:
    """Every floating tensor the cache's layers hold (rings, pages, scratch, frontiers, snapshots) filled with NaN;
    how many there were."""
    seen: set[int] = set()

    def visit(value) -> int:
        if id(value) in seen:
            return 0
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                value.fill_(float("nan"))
                return 1
            return 0
        if isinstance(value, (list, tuple)):
            return sum(visit(v) for v in value)
        if type(value).__module__.startswith("deepserve.model") and hasattr(value, "__dict__"):
            return sum(visit(v) for v in vars(value).values())
        return 0

    return visit(cache.layers)


def _no_stale_reads(llm, fresh) -> None:
    """`fresh`: the prompt's bits from `llm` before."""
    assert _poison(llm.cache) > 0
    after = _bits(llm, [PROMPT])
    assert after == fresh, f"after NaN pools {after} != fresh {fresh}: a kernel read a row it did not write"


def _modes(path) -> dict:
    """Each mode's bits for the prompt alone and beside others (the invariant mode also in 16-token chunks), each
    checked against the reference backend's first token; the default mode's eager layout checked for stale
    reads on the way."""
    from deepserve import LLM

    reference = _bits(LLM(model=str(path), accelerator="cpu", dtype="bfloat16", max_num_seqs=4, max_model_len=256),
                      [PROMPT])
    found = {}
    for name, invariant in (("invariant", True), ("default", False)):
        llm = _llm(path, batch_invariant=invariant, enforce_eager=True)
        assert llm.backend.invariant is invariant and llm.backend.cuda_graphs is not invariant
        alone = _bits(llm, [PROMPT])
        # the kernels compute the model: the prefill's token and its logprob are the reference ops' (later tokens
        # may part at a near-tie: bf16 rounds differently on each path)
        assert alone[0][0] == reference[0][0] and abs(alone[1][0] - reference[1][0]) < 0.1, (name, alone, reference)
        found[name] = {"alone": alone, "batched": _bits(llm, [PROMPT] + OTHERS)}
        if invariant:
            found[name]["chunked"] = _bits(_llm(path, batch_invariant=True, max_num_batched_tokens=16),
                                           [PROMPT] + OTHERS)
        else:
            _no_stale_reads(llm, alone)
    return found


def _static_layout_reads(path) -> None:
    llm = _llm(path)  # not eager: decode steps through the static layout (eager here: no CUDA on the CPU)
    _no_stale_reads(llm, _bits(llm, [PROMPT]))


def _top_two(llm) -> list[tuple[int, float, float]]:
    """The prompt's two greedy tokens from `llm`, each with its logprob and its lead over the second best."""
    from deepserve import SamplingParams

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                                      logprobs=2), use_tqdm=False)[0].outputs[0]
    steps = []
    for token, top in zip(out.token_ids, out.logprobs):
        best = sorted((v.logprob for v in top.values()), reverse=True)
        steps.append((token, top[token].logprob, best[0] - best[1]))
    return steps


def _stored(work: Path) -> dict:
    """Weights kept as stored (FP8 projections, FP4 experts: the demo widened to whole 128-row scale blocks and
    written as DeepSeek stores V4) through the kernels, in both modes: the greedy tokens and their logprobs against
    the reference backend's (which dequantizes; a token may differ only where the reference's two best are within
    0.1, and the comparison ends there). The default mode's prefill takes the grouped FP4 kernels, its
    decode steps the fused pairs-and-shared-expert kernels; the invariant mode takes the FP4 kernels with its
    fixed tiles and keeps the request's bits beside two others."""
    from deepserve import LLM
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.factory import load_model
    from deepserve.model.writer import save_checkpoint
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    demo = build_demo_checkpoint(work / "wide", seed=5, num_hidden_layers=2, num_hash_layers=1,
                                 layer_types=["sliding_attention", "compressed_sparse_attention"], hidden_size=256,
                                 head_dim=128, q_lora_rank=128, o_lora_rank=128, moe_intermediate_size=128,
                                 index_head_dim=128)
    stored = save_checkpoint(load_model(demo, ReferenceBackend("cpu"), "float32", progress=False), work / "stored",
                             quantization="fp8")
    reference = _top_two(LLM(model=str(stored), accelerator="cpu", dtype="bfloat16", max_num_seqs=4,
                             max_model_len=256))
    found = {"reference": reference}
    for name, invariant in (("default", False), ("invariant", True)):
        llm = _llm(stored, batch_invariant=invariant, enforce_eager=True)
        tokens, logprobs = _bits(llm, [PROMPT], tokens=2)  # the prompt's token, then a decode step's
        for step, (token, logprob, (ref_token, ref_logprob, margin)) in enumerate(zip(tokens, logprobs, reference)):
            if token != ref_token:  # only where the reference's two best are near (the paths round differently)
                assert margin < 0.1, (name, step, tokens, logprobs, reference)
                break
            assert abs(logprob - ref_logprob) < 0.1, (name, step, tokens, logprobs, reference)
        found[name] = [tokens, logprobs]
        if invariant:  # the FP4 experts' fixed tiles and routing-order sum keep the request's bits beside others
            batched = _bits(llm, [PROMPT] + OTHERS, tokens=2)
            assert batched == (tokens, logprobs), ("stored invariant", batched, tokens, logprobs)
    return found


def run_cases() -> dict[str, object]:
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    # one layer of each kind (window, CSA with its indexer, HCA), the first hash-routed: every kernel, half the time
    path = build_demo_checkpoint(Path(sys.argv[1]) / "demo", seed=3, num_hidden_layers=3, num_hash_layers=1,
                                 layer_types=["sliding_attention", "compressed_sparse_attention",
                                              "heavily_compressed_attention"])
    results: dict[str, object] = {}
    for name, case in (("modes", lambda: _modes(path)), ("stale-static", lambda: _static_layout_reads(path)),
                       ("stored", lambda: _stored(Path(sys.argv[1])))):
        try:
            results[name] = case() or "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test by name
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return run_child(__file__, tmp_path_factory.mktemp("interp"), timeout=900,
                     gpu_twin="tests/gpu/test_batch_invariant_gpu.py")


def test_no_kernel_reads_a_row_the_request_did_not_write(interpreted):
    """Eager (checked inside "modes", on the default mode's engine) and the static layout."""
    assert isinstance(interpreted["modes"], dict), interpreted["modes"]
    assert interpreted["stale-static"] == "ok", interpreted["stale-static"]


def test_the_batch_invariant_mode_keeps_a_requests_bits_whatever_shares_its_steps(interpreted):
    modes = interpreted["modes"]
    assert isinstance(modes, dict), modes
    inv = modes["invariant"]
    assert inv["batched"] == inv["alone"] and inv["chunked"] == inv["alone"], inv


def test_stored_weights_through_the_kernels_compute_the_model(interpreted):
    assert isinstance(interpreted["stored"], dict), interpreted["stored"]


def test_the_default_mode_is_not_batch_invariant_here(interpreted):
    """The control: without the mode, the same comparison sees other bits (gemv and cuBLAS-shaped GEMMs pick
    by rows, the one-token MoE kernel, split attention), so the invariance above is the mode's doing."""
    modes = interpreted["modes"]
    assert isinstance(modes, dict), modes
    default = modes["default"]
    assert default["batched"] != default["alone"], default


if __name__ == "__main__":
    child_main(run_cases)
