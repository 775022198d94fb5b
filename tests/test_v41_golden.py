"""deepserve's V4.1 against the committed golden directories made by DeepSeek's own reference
(deepserve/tools/v41_golden.py), by the layer-forced protocol of ../shared/v41-golden-format.md, and the checker's
command line (the deliberate bugs it must catch are in test_v41_mutations.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepserve.model.v41 import load_v41
from deepserve.tools import golden_check

GOLDENS = Path(__file__).parent / "golden" / "v41"
GOLDEN = GOLDENS / "tiny_a"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_v41(GOLDEN / "tiny")


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_golden_directory_passes_every_check(name):
    root = GOLDENS / name
    torch.set_num_threads(1)
    m = load_v41(root / "tiny")  # sizes and roles from the directory's own config
    rep = golden_check.run(root, "all", model=m)
    assert rep.ok, rep.table()
    names = {r.check for r in rep.rows}
    # every block, both phases, every index source's selections, Engram ids, DSpark and the end-to-end checks
    for j in range(m.cfg.n_layers):
        assert f"forced prefill L{j} relRMS" in names and f"forced decode L{j} relRMS" in names
    for j in m.cfg.engram_layer_ids:
        assert f"engram ids prefill L{j}" in names and f"engram ids decode L{j}" in names
    for j in m.cfg.index_source_layers:
        assert f"topk rows L{j} (rows differing)" in names
    assert {f"candidates L{m.cfg.candidate_source_layer} (rows differing)", "dspark drafts (stable steps differing)",
            "dspark logits max|d|", "e2e decode logprobs (worst |d|/limit)",
            "e2e greedy tokens (stable steps differing)"} <= names


def test_cli_exit_codes(tmp_path, capsys):
    assert golden_check.main([str(tmp_path)]) == 2  # not a golden directory
    assert "reference.json is missing" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(GOLDEN, broken)
    layers = load_file(str(broken / "reference_layers.safetensors"))
    layers["p0.decode.layer3.x_out"] = (layers["p0.decode.layer3.x_out"].float() * 1.2).to(torch.bfloat16)
    save_file(layers, str(broken / "reference_layers.safetensors"))
    assert golden_check.main([str(broken), "--json", str(tmp_path / "rows.json")]) == 1
    out = capsys.readouterr().out
    assert "forced decode L3 relRMS" in out and "FAIL" in out
    assert (tmp_path / "rows.json").is_file()


def test_a_directory_without_envelopes_is_held_to_the_formats_numbers(tmp_path):
    """The minimal format (refs, logits, layers; no envelope sections, top-k rows as lists) is still checked:
    the limits fall back to the spreads the golden format reports."""
    import json

    root = tmp_path / "minimal"
    shutil.copytree(GOLDENS / "tiny_b", root)
    doc = json.loads((root / "reference.json").read_text())
    for key in ("layer_forced", "end_to_end_sharpness", "dspark_seed_consistency", "topk_boundary_ties"):
        doc.pop(key, None)
    for ref in doc["refs"]:
        for key in ("envelope", "envelope_members", "consistency"):
            ref.pop(key, None)
        for step in ref["decode_steps"]:
            step["topk_rows"] = list(step["topk_rows"].values())
    (root / "reference.json").write_text(json.dumps(doc))
    rep = golden_check.run(root, "all", prompts={0})
    assert rep.ok, rep.table()
    assert any(r.note == "doc envelope" for r in rep.rows)
    assert any(r.check == "decode topk rows (steps differing)" for r in rep.rows)
