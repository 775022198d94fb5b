"""The V4.1 model's parts: both config spellings, layer roles as state owners, the released-layout loader's
errors, Engram hashing, the stored-precision numerics, the registry, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepserve.model.registry import model_class
from deepserve.model.v41 import DeepseekV41ForCausalLM, V41CheckpointError, V41Config, V41ConfigError, load_v41
from deepserve.model.v41.loader import load_state, load_tokenizer, read_tensors
from deepserve.model.v41.numerics import fp4_fake_quant, fp8_fake_quant, pow2_ceil, round_e2m1

TINY = Path(__file__).parent / "golden" / "v41" / "tiny_a" / "tiny"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_v41(TINY)


def hf_config() -> dict:
    return json.loads((TINY / "config.json").read_text())


def test_both_config_spellings_read_the_same_model():
    a = V41Config.from_hf(hf_config())
    b = V41Config.from_reference(json.loads((TINY / "inference" / "config.json").read_text()))
    assert a == b
    assert (a.n_layers, a.dim, a.window_size, a.kv_source_layers) == (8, 128, 32, (2, 4))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(compress_ratios=t["compress_ratios"][:-1]), "compress_ratios has 9 entries"),
    (lambda t: t.update(kv_source_layer_ids=[2]), "nearest kv source"),
    (lambda t: t.update(candidate_source_layer_id=5), "candidate source 5 is not an index source"),
    (lambda t: t.update(index_source_layer_ids=[2, 4, 6], candidate_source_layer_id=2), "their ratios must match"),
    (lambda t: t.update(num_key_value_heads=2), "one K=V head"),
    (lambda t: t.pop("index_topk"), "config lacks ['index_topk']"),
])
def test_bad_configs_are_refused_by_name(edit, message):
    cfg = hf_config()
    edit(cfg["text_config"])
    with pytest.raises(V41ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        V41Config.from_hf(cfg)


def test_registered_under_its_model_type():
    cls = model_class("deepseek_v41")
    assert cls is DeepseekV41ForCausalLM
    assert cls(hf_config()).cfg == V41Config.from_hf(hf_config())  # built from the HF config as the registry does


def test_layer_roles_are_state_owners(model):
    owners = model.state_owners()
    specs = owners["layers"]
    assert [s.role for s in specs] == ["window", "window", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert [s.layer for s in specs if s.owns_rows] == [2, 4]  # only kv sources grow per token
    assert [s.kv_source for s in specs] == [None, None, 2, 2, 4, 4, 4, 4]
    assert [s.index_source for s in specs] == [None, None, 2, 2, 4, 4, 6, 6]
    assert specs[4].candidate_source and specs[2].frontier == 1 and specs[4].frontier == 0
    assert len(owners["dspark_layers"]) == 2 and owners["engram"][0].history == 3
    state = model.make_state()
    assert state.layers[3].rows is None and state.layers[2].rows.shape == (0, 64)


def test_state_grows_only_at_the_sources(model):
    state = model.make_state()
    model.forward(list(range(3, 24)), state)  # 21 tokens
    assert state.layers[2].rows.shape[0] == 10 and state.layers[4].rows.shape[0] == 21
    assert state.layers[2].index_keys.shape == (10, 64) and state.layers[4].index_keys.shape == (21, 64)
    model.forward([5], state)  # position 21 closes the ratio-2 group 10
    assert state.layers[2].rows.shape[0] == 11 and state.num_tokens == 22


def test_incremental_engram_hash_equals_one_pass(model):
    ids = torch.tensor([0, 7, 7, 9, 300, 12, 12, 2, 44])
    whole, _ = model.hasher.hash([], ids)
    hist, parts = [], []
    for chunk in (ids[:4], ids[4:5], ids[5:6], ids[6:]):
        part, hist = model.hasher.hash(hist, chunk)
        parts.append(part)
    assert torch.equal(torch.cat(parts), whole)
    cols = (model.cfg.engram_max_ngram_size - 1) * model.cfg.engram_n_heads
    assert whole.shape == (9, 2, cols)
    for li, rows in enumerate(model.cfg.engram_num_embeddings):  # each layer's ids stay inside its table
        assert 0 <= int(whole[:, li].min()) and int(whole[:, li].max()) < rows


def test_engram_normalizes_case_and_accents():
    from deepserve.model.v41.engram import normalized_token_map

    tok = load_tokenizer(TINY)
    table, size = normalized_token_map(tok)
    vocab = tok.get_vocab()
    assert table[vocab["ba"]] == table[vocab["Ba"]] == table[vocab["BA"]] == table[vocab[" ba"]]
    assert table[vocab["ba"]] == table[vocab["bá"]] and table[vocab["ba"]] != table[vocab["be"]]
    assert size == V41Config.from_hf(hf_config()).engram_compressed_vocab_size


def test_loader_names_missing_and_extra_tensors(model):
    tensors = read_tensors(TINY)
    missing = dict(tensors)
    missing.pop("layers.3.ffn.experts.1.w2.scale")
    with pytest.raises(V41CheckpointError, match="layers.3.ffn.experts.1.w2.scale"):
        load_state(DeepseekV41ForCausalLM(model.cfg, tokenizer=load_tokenizer(TINY)), missing)
    extra = dict(tensors, **{"layers.3.attn.compressor.wkv.weight": tensors["layers.2.attn.compressor.wkv.weight"]})
    with pytest.raises(V41CheckpointError, match="match nothing"):
        load_state(DeepseekV41ForCausalLM(model.cfg, tokenizer=load_tokenizer(TINY)), extra)
    wrong = dict(tensors, **{"layers.0.attn.wq_a.weight": tensors["layers.0.attn.wq_a.weight"].float()})
    with pytest.raises(V41CheckpointError, match="stores it FP8"):
        load_state(DeepseekV41ForCausalLM(model.cfg, tokenizer=load_tokenizer(TINY)), wrong)


def test_released_layout_is_read_as_stored(model):
    tensors = read_tensors(TINY)
    assert tensors["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert all(f"layers.{j}.ffn.gate.bias_vl" in tensors for j in range(model.cfg.n_layers))
    expert = model.layers[0].ffn.experts[0].w1
    assert expert.kind == "fp4" and expert.values.shape == (64, 128)
    assert set(expert.values.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert model.layers[2].attn.c_wkv.dtype == torch.float32 and model.layers[4].attn.c_wkv.dtype == torch.bfloat16
    assert model.layers[0].attn.wo_a.dtype == torch.bfloat16


def test_e2m1_rounds_to_nearest_even_on_its_grid():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_e2m1(mids).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_e2m1(-mids).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert round_e2m1(torch.tensor([0.26, 2.49, 5.01, 6.0])).tolist() == [0.5, 2.0, 6.0, 6.0]


def test_scales_are_powers_of_two_rounded_up():
    x = torch.tensor([1.0, 1.5, 2.0, 3.0, 2.0**-20 * 1.1])
    assert pow2_ceil(x).tolist() == [1.0, 2.0, 2.0, 4.0, 2.0**-19]
    v = torch.randn(4, 64).bfloat16()
    q8 = fp8_fake_quant(v)
    assert q8.dtype == torch.bfloat16 and float((q8.float() - v.float()).abs().max()) < 0.1 * float(v.abs().max())
    q4 = fp4_fake_quant(v, 16, True)
    groups = (q4.float().unflatten(-1, (-1, 16)))
    assert all(len(g.abs().unique()) <= 8 for g in groups.reshape(-1, 16))


def test_refusals_say_why(model):
    state = model.make_state()
    with pytest.raises(ValueError, match="vision"):
        model.forward([1, model.cfg.image_token_id], state)
    model.forward([3, 4, 5], state)
    model.forward([6, 7], state)  # a later chunk is taken (tests/test_v41_engine.py checks what it computes)
    assert state.num_tokens == 5


def test_engram_tables_can_stay_in_host_memory(model):
    placed = load_v41(TINY, engram_device="cpu")
    tables = [blk.engram.table for blk in placed.layers if blk.engram is not None]
    assert len(tables) == len(placed.cfg.engram_layer_ids)
    assert all(t.weight.device.type == "cpu" and t.weight.dtype == torch.float8_e4m3fn for t in tables)
    ids = list(range(3, 20))
    a = placed.forward(ids, placed.make_state()).logits
    b = model.forward(ids, model.make_state()).logits
    assert torch.equal(a, b)


def test_reference_spelling_is_read_when_the_hf_one_is_unusable(tmp_path):
    import shutil

    d = tmp_path / "tiny"
    shutil.copytree(TINY, d)
    cfg = hf_config()
    del cfg["text_config"]["hc_mult"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert V41Config.from_dir(d) == V41Config.from_hf(hf_config())
    (d / "inference" / "config.json").unlink()
    with pytest.raises(V41ConfigError, match="hc_mult"):
        V41Config.from_dir(d)
