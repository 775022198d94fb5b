"""Weights kept as stored (`--quantization`): FP8 dense + FP4 experts in memory, the reference backend's
dequantizing forward as the oracle (bitwise the load-time dequantization), quantizing a bf16 checkpoint at load,
the writer, memory accounting, and the errors a user can hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepserve.backends.reference import ReferenceBackend
from deepserve.cli import build_parser, engine_options
from deepserve.core.config import EngineConfig
from deepserve.llm import LLM
from deepserve.model import quant
from deepserve.model.batch import make_batch
from deepserve.model.factory import load_model, weight_bytes
from deepserve.model.loader import CheckpointConfigError, CheckpointError
from deepserve.model.writer import save_checkpoint
from deepserve.core.sampling_params import SamplingParams

torch.set_num_threads(1)
BACKEND = ReferenceBackend("cpu")


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return load_model(tiny_dir, BACKEND, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def fp8_dir(plain, tmp_path_factory) -> Path:
    """The tiny model in DeepSeek's stored form: FP8 128x128 dense projections, FP4 routed experts."""
    return save_checkpoint(plain, tmp_path_factory.mktemp("fp8"), quantization="fp8")


def logits(model, n: int = 40) -> torch.Tensor:
    ids = torch.randint(2, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        return model(make_batch([ids], [0], "cpu", logits_rows=[range(n)]), [model.make_state()]).logits


def test_stored_checkpoint_has_deepseeks_layout(fp8_dir):
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                             "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                             "expert_dtype": "fp4"}
    state = load_file(fp8_dir / "model.safetensors")
    assert state["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert state["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (1, 1)
    assert state["model.layers.0.mlp.experts.3.w1.weight"].dtype == torch.int8  # per expert, packed
    assert state["model.layers.0.mlp.experts.3.w1.weight_scale_inv"].shape == (32, 2)  # one per 32 of 64 inputs
    # DeepSeek keeps the router, compressors, indexer weights, embedding and head in bf16
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.self_attn.compressor.kv_proj.weight",
                 "model.embed_tokens.weight", "lm_head.weight"):
        assert state[name].dtype == torch.float32 and name + "_scale_inv" not in state


def test_stored_weights_forward_equals_load_time_dequantization_bitwise(plain, fp8_dir, tiny_dir):
    stored = load_model(fp8_dir, BACKEND, dtype="float32", progress=False)  # auto: as the config says
    dequantized = load_model(fp8_dir, BACKEND, dtype="float32", progress=False, quantization="none")
    at_load = load_model(tiny_dir, BACKEND, dtype="float32", progress=False, quantization="fp8")
    q_a = stored.model.layers[0].self_attn.q_a_proj
    assert q_a.weight.dtype == torch.float8_e4m3fn and q_a.stored() is not None
    assert stored.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.int8
    assert dequantized.model.layers[0].self_attn.q_a_proj.stored() is None
    reference = logits(dequantized)
    assert torch.equal(logits(stored), reference)
    assert torch.equal(logits(at_load), reference)  # a bf16 checkpoint quantized at load is the same model
    # the quantization is real: the stored model is not the unquantized one
    assert not torch.allclose(reference, logits(plain), atol=1e-3)


def test_stored_projections_of_one_input_run_as_one_gemm(plain, tmp_path):
    # V4.1's 32x32 blocks: the tiny model's 32-row projections are whole blocks, so q_a and kv (FP8) stack, as do
    # the compressor's bf16 projections in their own group, and the shared expert's gate and up
    path = save_checkpoint(plain, tmp_path / "b32", quantization="fp8", scheme=quant.QuantScheme((32, 32), "fp4"))
    stored = load_model(path, BACKEND, dtype="float32", progress=False)
    attn = stored.model.layers[2].self_attn
    fp8_group, bf16_group = attn.q_a_proj.shared, attn.compressor.kv_proj.shared
    assert fp8_group is not None and fp8_group.scale is not None and attn.kv_proj.shared is fp8_group
    assert bf16_group is not None and bf16_group.scale is None and bf16_group is not fp8_group
    assert stored.model.layers[0].mlp.shared_experts.gate_proj.shared.scale is not None
    assert torch.equal(logits(stored), logits(load_model(path, BACKEND, dtype="float32", progress=False,
                                                         quantization="none")))


def test_memory_accounting_counts_stored_bytes(plain, fp8_dir):
    stored = load_model(fp8_dir, BACKEND, dtype="float32", progress=False)
    buffers, saved = dict(stored.named_buffers()), 0
    for name, p in stored.named_parameters():
        scale = buffers.get(quant.scale_name(name))
        if scale is not None:  # fp32 [N, K] -> fp8 [N, K] or packed FP4 [N, K/2], plus the scales
            saved += p.numel() * (2 if p.dtype == torch.int8 else 1) * 4 - p.nbytes - scale.nbytes
    assert saved > 0 and weight_bytes(stored) == weight_bytes(plain) - saved


def test_stored_expert_slices_dequantize_like_the_stack():
    w = torch.randn(3, 8, 64)
    data, scale = quant.quantize_fp4(w)
    stack = quant.QuantizedWeight(data, scale, (1, 32))
    assert stack.shape == (3, 8, 64) and stack.fp4
    full = stack.dequantize(torch.float32)
    for e in range(3):
        assert torch.equal(stack.expert(e).dequantize(torch.float32), full[e])
        assert torch.equal(full[e], quant.dequantize_fp4(*quant.quantize_fp4(w[e])))
    data8, scale8 = quant.quantize_fp8(w, block=(4, 32))
    assert scale8.shape == (3, 2, 2)
    assert torch.allclose(quant.QuantizedWeight(data8, scale8, (4, 32)).dequantize(torch.float32), w, rtol=0.07,
                          atol=1e-2)


def test_writer_round_trips_a_stored_model(fp8_dir, tmp_path):
    stored = load_model(fp8_dir, BACKEND, dtype="float32", progress=False)
    again = save_checkpoint(stored, tmp_path / "again")  # stored weights are written as they are
    a, b = load_file(fp8_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1
                                                        else a[k], b[k].view(torch.uint8)
                                                        if b[k].element_size() == 1 else b[k]) for k in a)


def test_engine_on_a_stored_checkpoint(fp8_dir, tiny_dir):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    prompts = [[5, 9, 33, 17, 2, 80, 41, 7], [3, 4, 5]]
    stored = LLM(fp8_dir, dtype="float32", accelerator="cpu").generate(prompts, params, use_tqdm=False)
    at_load = LLM(tiny_dir, dtype="float32", accelerator="cpu", quantization="fp8").generate(prompts, params,
                                                                                             use_tqdm=False)
    for a, b in zip(stored, at_load):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 6
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_cli_and_config_take_the_flag():
    args = build_parser().parse_args(["serve", "some/model", "--quantization", "fp8"])
    assert engine_options(args)["quantization"] == "fp8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="not supported with enable_expert_parallel"):
        EngineConfig(model="m", quantization="fp8", enable_expert_parallel=True, data_parallel_size=2)


def _rewrite(src: Path, dst: Path, config_edit=None, tensor_edit=None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(src / "model.safetensors")
    if tensor_edit:
        tensor_edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("field, value, message", [
    ("quant_method", "awq", "quant_method 'awq' is not supported"),
    ("fmt", "e5m2", "fmt 'e5m2' is not supported"),
    ("activation_scheme", "static", "activation_scheme 'static' is not supported"),
    ("weight_block_size", [128], r"weight_block_size must be \[rows, cols\]"),
    ("weight_block_size", [0, 128], "weight_block_size must be two positive integers"),
    ("expert_dtype", "int4", "expert_dtype must be 'fp4' or 'fp8'"),
])
def test_bad_quantization_config_is_named(fp8_dir, tmp_path, field, value, message):
    bad = _rewrite(fp8_dir, tmp_path / "bad", config_edit=lambda c: c["quantization_config"].update({field: value}))
    with pytest.raises(CheckpointConfigError, match=message):
        load_model(bad, BACKEND, dtype="float32", progress=False)


def test_scales_that_do_not_fit_the_config_are_named(fp8_dir, tmp_path):
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    # V4.1's 32x32 blocks in the config, but the file's scales are 128x128 ones
    blocks = _rewrite(fp8_dir, tmp_path / "blocks",
                      config_edit=lambda c: c["quantization_config"].update(weight_block_size=[32, 32]))
    with pytest.raises(CheckpointError, match=r"does not match the 32x32 blocks of weight_block_size"):
        load_model(blocks, BACKEND, dtype="float32", progress=False)
    shape = _rewrite(fp8_dir, tmp_path / "shape", tensor_edit=lambda s: s.update({name: s[name].repeat(2, 1)}))
    with pytest.raises(CheckpointError, match=r"q_a_proj.weight: FP8 weight \(32, 64\) with scales \(2, 1\)"):
        load_model(shape, BACKEND, dtype="float32", progress=False)
    expert = "model.layers.0.mlp.experts.0.w2.weight_scale_inv"
    fp4 = _rewrite(fp8_dir, tmp_path / "fp4", tensor_edit=lambda s: s.update({expert: s[expert][:, :0]}))
    with pytest.raises(CheckpointError, match="packed FP4 weight .* needs scales"):
        load_model(fp4, BACKEND, dtype="float32", progress=False)
    # without the config (quantization auto) the same file dequantizes, and says what is wrong there too
    with pytest.raises(CheckpointError, match="needs scales"):
        load_model(shape, BACKEND, dtype="float32", progress=False, quantization="none")
