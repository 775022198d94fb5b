"""Checkpoint loader: three tensor spellings, shards, FP8/FP4 dequantization, and every error a user can hit."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepserve.core.config import ConfigError
from deepserve.model import quant
from deepserve.model.loader import (
    CheckpointConfigError,
    CheckpointError,
    find_weight_files,
    load_weights,
    read_checkpoint,
)
from deepserve.model.weight_names import canonical_name, keeps_fp32
from tiny import make_hf_model, save_hf_checkpoint

torch.set_num_threads(1)

# canonical block leaf (after `model.layers.{i}.` or `mtp.{k}.`) -> official leaf; experts are handled apart
OFFICIAL_LEAF = {
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{hf}.{leaf}": f"hc_{off}_{leaf}" for hf, off in (("attn_hc", "attn"), ("ffn_hc", "ffn"))
       for leaf in ("fn", "base", "scale")},
    **{f"hc_head.hc_{leaf}": f"hc_head_{leaf}" for leaf in ("fn", "base", "scale")},
    **{f"{m}.weight": f"{m}.weight" for m in ("enorm", "hnorm", "e_proj", "h_proj", "norm")},
}
OFFICIAL_ROOT = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                 "model.norm.weight": "norm.weight",
                 **{f"model.hc_head.hc_{x}": f"hc_head_{x}" for x in ("fn", "base", "scale")}}
FP8_LEAVES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
              "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
              "shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")


def to_official(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a canonical state dict to the official release layout, splitting stacked experts per expert."""
    out = {}
    for name, tensor in state.items():
        if name in OFFICIAL_ROOT:
            out[OFFICIAL_ROOT[name]] = tensor
            continue
        scope, index, leaf = name.removeprefix("model.").split(".", 2)
        prefix = f"{scope}.{index}."
        if leaf == "mlp.experts.gate_up_proj":
            half = tensor.shape[1] // 2
            for e, w in enumerate(tensor):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = w[:half].clone()
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = w[half:].clone()
        elif leaf == "mlp.experts.down_proj":
            for e, w in enumerate(tensor):
                out[f"{prefix}ffn.experts.{e}.w2.weight"] = w.clone()
        else:
            out[prefix + OFFICIAL_LEAF[leaf]] = tensor
    return out


def mtp_block(state: dict[str, torch.Tensor], seed: int = 7) -> dict[str, torch.Tensor]:
    """A canonical `mtp.0.*` block: layer 3's tensors (a non-hash MoE layer) plus the MTP-only ones."""
    g = torch.Generator().manual_seed(seed)
    out = {"mtp.0." + k.removeprefix("model.layers.3."): v.clone()
           for k, v in state.items() if k.startswith("model.layers.3.") and ".compressor." not in k}
    dim = state["model.norm.weight"].shape[0]
    for leaf, shape in (("enorm.weight", (dim,)), ("hnorm.weight", (dim,)), ("norm.weight", (dim,)),
                        ("e_proj.weight", (dim, dim)), ("h_proj.weight", (dim, dim)),
                        ("hc_head.hc_fn", state["model.hc_head.hc_fn"].shape),
                        ("hc_head.hc_base", state["model.hc_head.hc_base"].shape),
                        ("hc_head.hc_scale", state["model.hc_head.hc_scale"].shape)):
        out["mtp.0." + leaf] = torch.randn(shape, generator=g) * 0.1
    return out


def write_dir(path: Path, model, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    model.config.to_json_file(path / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def model():
    return make_hf_model(0)


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    canonical = dict(model.state_dict())
    with_mtp = {**canonical, **mtp_block(canonical)}
    return {
        "hybrid": save_hf_checkpoint(model, root / "hybrid"),
        "hf": write_dir(root / "hf", model, with_mtp),
        "official": write_dir(root / "official", model, to_official(with_mtp)),
    }


def logits(model, seed: int = 3) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


# ---- spellings -------------------------------------------------------------------------------------------------

def test_hybrid_file_really_uses_hybrid_names(ckpt):
    with safe_open(ckpt["hybrid"] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"head.weight", "model.embed_tokens.weight", "model.layers.0.attn.norm.weight",
            "model.layers.2.attn.compressor.norm.weight", "model.layers.0.ffn.experts.0.w1.weight"} <= keys


def test_three_spellings_give_identical_canonical_dicts(model, ckpt):
    hybrid, hf, official = (read_checkpoint(ckpt[k], progress=False) for k in ("hybrid", "hf", "official"))
    assert_same(hf, official)
    assert_same(hybrid, {k: v for k, v in hf.items() if not k.startswith("mtp.")})
    assert_same(hybrid, dict(model.state_dict()))
    expected_mtp = {"mtp.0.self_attn.q_a_proj.weight", "mtp.0.mlp.experts.gate_up_proj", "mtp.0.mlp.experts.down_proj",
                    "mtp.0.mlp.gate.e_score_correction_bias", "mtp.0.input_layernorm.weight",
                    "mtp.0.post_attention_layernorm.weight", "mtp.0.attn_hc.fn", "mtp.0.ffn_hc.scale",
                    "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight",
                    "mtp.0.hc_head.hc_fn", "mtp.0.hc_head.hc_base", "mtp.0.hc_head.hc_scale", "mtp.0.norm.weight"}
    assert expected_mtp <= set(official)
    assert torch.equal(official["mtp.0.mlp.experts.gate_up_proj"], model.state_dict()["model.layers.3.mlp.experts.gate_up_proj"])


@pytest.mark.parametrize("spelling", ["hybrid", "hf", "official"])
def test_fresh_model_reproduces_logits_exactly(model, ckpt, spelling, caplog):
    fresh = make_hf_model(1)
    assert not torch.equal(logits(fresh), logits(model))
    with caplog.at_level(logging.WARNING, logger="deepserve.model.loader"):
        load_weights(fresh, read_checkpoint(ckpt[spelling], progress=False))
    assert torch.equal(logits(fresh), logits(model))
    assert ("mtp.0." in caplog.text) == (spelling != "hybrid")


def test_progress_bar_can_be_switched_off(ckpt, capsys):
    read_checkpoint(ckpt["hybrid"], progress=True)
    assert "Loading weights" in capsys.readouterr().err
    read_checkpoint(ckpt["hybrid"], progress=False)
    assert capsys.readouterr().err == ""


def test_strict_unexpected_rejects_mtp_for_a_model_without_it(ckpt):
    with pytest.raises(CheckpointError, match="mtp.0."):
        load_weights(make_hf_model(1), read_checkpoint(ckpt["official"], progress=False), strict_unexpected=True)


def test_bf16_keeps_fp32_modules_and_int64_tid2eid(ckpt):
    state = read_checkpoint(ckpt["official"], dtype=torch.bfloat16, progress=False)
    assert state["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
    for name in ("model.layers.0.attn_hc.fn", "model.layers.0.self_attn.sinks", "model.norm.weight",
                 "model.layers.3.mlp.gate.e_score_correction_bias", "model.hc_head.hc_scale", "mtp.0.enorm.weight",
                 "model.layers.2.self_attn.compressor.position_bias", "model.layers.2.self_attn.kv_norm.weight"):
        assert state[name].dtype == torch.float32, name
    assert state["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16


@pytest.mark.parametrize(("source", "canonical"), [
    ("model.layers.2.attn.norm.weight", "model.layers.2.self_attn.kv_norm.weight"),
    ("layers.2.attn.kv_norm.weight", "model.layers.2.self_attn.kv_norm.weight"),
    ("model.layers.2.attn.compressor.norm.weight", "model.layers.2.self_attn.compressor.kv_norm.weight"),
    ("layers.2.attn.indexer.compressor.ape", "model.layers.2.self_attn.compressor.indexer.position_bias"),
    ("layers.0.attn.wq_a.scale", "model.layers.0.self_attn.q_a_proj.weight_scale_inv"),
    ("layers.2.attn.indexer.wq_b.scale", "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight_scale_inv"),
    ("model.layers.0.attn_hc.scale", "model.layers.0.attn_hc.scale"),
    ("layers.0.hc_ffn_scale", "model.layers.0.ffn_hc.scale"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
    ("head.weight", "lm_head.weight"),
    ("mtp.0.hc_head_fn", "mtp.0.hc_head.hc_fn"),
    ("mtp.0.e_proj.scale", "mtp.0.e_proj.weight_scale_inv"),
    ("mtp.0.ffn.experts.5.w3.weight", "mtp.0.mlp.experts.5.w3.weight"),
])
def test_canonical_name_rules(source, canonical):
    assert canonical_name(source) == canonical
    assert canonical_name(canonical) == canonical


def test_canonical_names_are_fixed_points(model):
    for name in model.state_dict():
        assert canonical_name(name) == name
    assert keeps_fp32("model.layers.0.self_attn.sinks") and not keeps_fp32("model.layers.0.self_attn.o_a_proj.weight")


# ---- file layouts ----------------------------------------------------------------------------------------------

def test_sharded_checkpoint_with_index(ckpt, tmp_path):
    state = read_checkpoint(ckpt["official"], progress=False)
    with safe_open(ckpt["official"] / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    shutil.copy(ckpt["official"] / "config.json", shard_dir)
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = names[i::3]
        save_file({k: tensors[k] for k in part}, shard_dir / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(find_weight_files(shard_dir)) == 3
    assert_same(read_checkpoint(shard_dir, progress=False), state)

    (shard_dir / "model.safetensors.index.json").unlink()  # no index: every *.safetensors file is read
    assert_same(read_checkpoint(shard_dir, progress=False), state)


# ---- quantized checkpoints -------------------------------------------------------------------------------------

def naive_fp8(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    exps = e.view(torch.uint8).int() - 127
    grid = torch.kron(exps, torch.ones(128, 128, dtype=torch.int32))[: q.shape[0], : q.shape[1]]
    return torch.ldexp(q.float(), grid)


def naive_fp4(packed: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    raw = packed.view(torch.uint8).int()
    out = torch.empty(packed.shape[0], packed.shape[1] * 2)
    for column, codes in ((0, raw % 16), (1, raw // 16)):
        out[:, column::2] = table[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    exps = (e.view(torch.uint8).int() - 127).repeat_interleave(32, dim=1)[:, : out.shape[1]]
    return torch.ldexp(out, exps)


@pytest.mark.parametrize("scale_as_uint8", [False, True] if quant.E8M0 is not None else [True])
def test_fp8_fp4_checkpoint_equals_its_dequantized_twin(tmp_path, scale_as_uint8):
    big = make_hf_model(2, hidden_size=160, q_lora_rank=144)  # dims >= 128 and not multiples of 128
    official = to_official({**big.state_dict(), **mtp_block(big.state_dict())})
    quantized, twin = {}, {}
    for name, tensor in official.items():
        if ".ffn.experts." in name:
            q, e = quant.quantize_fp4(tensor, scale_as_uint8=scale_as_uint8)
            deq = naive_fp4(q, e)
        elif name.endswith(FP8_LEAVES):
            q, e = quant.quantize_fp8(tensor, scale_as_uint8=scale_as_uint8)
            deq = naive_fp8(q, e)
        else:
            quantized[name] = twin[name] = tensor
            continue
        quantized[name], quantized[name.removesuffix("weight") + "scale"] = q, e
        twin[name] = deq
        assert (deq - tensor).abs().max() <= tensor.abs().max() * 0.25, name  # a real, not degenerate, quantizer
    assert quantized["layers.0.attn.wq_a.scale"].shape == (2, 2)
    assert quantized["layers.2.ffn.experts.0.w1.weight"].dtype == torch.int8
    got = read_checkpoint(write_dir(tmp_path / "q", big, quantized), progress=False)
    assert_same(got, read_checkpoint(write_dir(tmp_path / "twin", big, twin), progress=False))
    load_weights(big, got)
    assert torch.isfinite(logits(big)).all()


def test_fp8_in_hf_spelling_with_weight_scale_inv(model, tmp_path):
    state = dict(model.state_dict())
    name = "model.layers.0.self_attn.q_a_proj.weight"
    q, e = quant.quantize_fp8(state[name])
    state[name], state[name.removesuffix("weight") + "weight_scale_inv"] = q, e
    got = read_checkpoint(write_dir(tmp_path / "c", model, state), progress=False)
    assert torch.equal(got[name], naive_fp8(q, e))
    assert not any(k.endswith("scale_inv") for k in got)


def test_quantizer_round_trips_and_packs_low_nibble_first():
    w = torch.randn(200, 300)
    q, e = quant.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and e.shape == (2, 3)
    assert torch.equal(quant.dequantize_fp8(q, e), naive_fp8(q, e))
    assert torch.allclose(quant.dequantize_fp8(q, e), w, rtol=0.07, atol=1e-3)
    packed, scale = quant.quantize_fp4(torch.tensor([[0.5, -6.0] + [0.0] * 30]))
    assert scale.view(torch.uint8).item() == 127 and packed[0, 0].view(torch.uint8).item() == 0xF1
    assert quant.dequantize_fp4(packed, scale)[0, :2].tolist() == [0.5, -6.0]


# ---- errors ----------------------------------------------------------------------------------------------------

def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="nope"):
        read_checkpoint(tmp_path / "nope", progress=False)


def test_missing_config_json(ckpt, tmp_path):
    path = copy_ckpt(ckpt["hybrid"], tmp_path / "c")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        read_checkpoint(path, progress=False)


def test_no_safetensors_files(ckpt, tmp_path):
    path = copy_ckpt(ckpt["hybrid"], tmp_path / "c")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors"):
        read_checkpoint(path, progress=False)


def test_corrupt_safetensors_names_the_file(ckpt, tmp_path):
    path = copy_ckpt(ckpt["hybrid"], tmp_path / "c")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"c/model\.safetensors"):
        read_checkpoint(path, progress=False)


def test_unsupported_architecture(ckpt, tmp_path):
    path = copy_ckpt(ckpt["hybrid"], tmp_path / "c")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointConfigError, match=r"config\.json.*unsupported architecture") as info:
        read_checkpoint(path, progress=False)
    assert isinstance(info.value, ConfigError)


def test_missing_shard_names_it(ckpt, tmp_path):
    path = copy_ckpt(ckpt["hybrid"], tmp_path / "c")
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weight_map = {"head.weight": "model-00001-of-00002.safetensors", "norm.weight": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        read_checkpoint(path, progress=False)


def test_missing_expert_tensor_names_it(model, tmp_path):
    official = to_official(dict(model.state_dict()))
    del official["layers.2.ffn.experts.5.w3.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.w3"):
        read_checkpoint(write_dir(tmp_path / "c", model, official), progress=False)


def test_missing_tensor_names_it(ckpt):
    state = read_checkpoint(ckpt["hybrid"], progress=False)
    del state["model.layers.4.self_attn.sinks"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.self_attn\.sinks"):
        load_weights(make_hf_model(1), state)


def test_shape_mismatch_names_both_shapes(ckpt):
    state = read_checkpoint(ckpt["hybrid"], progress=False)
    state["model.norm.weight"] = torch.ones(65)
    fresh = make_hf_model(1)
    before = logits(fresh)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        load_weights(fresh, state)
    assert torch.equal(logits(fresh), before)  # nothing was copied


def test_parameters_on_meta_take_the_checkpoints_tensors_in_place(ckpt):
    """`load_model` builds the parameters as meta shapes and puts the checkpoint's tensors in their place (no
    device copy of the model beside the checkpoint's); buffers are made as a device build makes them."""
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.factory import build_model, materialize
    from deepserve.model.loader import read_config

    cfg, backend = read_config(ckpt["official"]), ReferenceBackend("cpu")
    model = build_model(cfg, backend, torch.float32, params_on_meta=True)
    plain = build_model(cfg, backend, torch.float32)
    assert all(p.is_meta for p in model.parameters())
    assert [(n, b.dtype, b.shape) for n, b in model.named_buffers()] == \
        [(n, b.dtype, b.shape) for n, b in plain.named_buffers()]
    for (name, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
        assert not b.is_meta and torch.equal(b, c), name
    assert [(n, p.dtype) for n, p in model.named_parameters()] == [(n, p.dtype) for n, p in plain.named_parameters()]
    state = read_checkpoint(ckpt["official"], progress=False)
    load_weights(model, state)
    for name, p in model.named_parameters():
        assert not p.is_meta and p.data_ptr() == state[name].data_ptr(), name
    assert all(not p.is_meta for p in materialize(build_model(cfg, backend, torch.bfloat16, params_on_meta=True),
                                                   "cpu").parameters())
