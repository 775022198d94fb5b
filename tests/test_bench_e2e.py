"""bench/e2e.py's harness on the CPU (its GPU run is a device call): `--quick --part offline` writes a record with
every row its table reads, a table of --quick records stays out of the docs, and `--table` replaces the table
between the doc's markers and nothing else. Nothing here asserts a time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "bench" / "e2e.py"
BEGIN, END = "<!-- bench/e2e.py table: begin -->", "<!-- bench/e2e.py table: end -->"


def e2e(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(E2E), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("e2e")
    e2e("--quick", "--part", "offline", "--out", str(out))
    return out


def finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def test_quick_offline_record_has_every_row(offline):
    rec = json.loads((offline / "e2e_offline.json").read_text())
    assert rec["part"] == "offline" and rec["quick"] and rec["device"] == "cpu"
    batches = [str(b) for b in rec["plan"]["batches"]]
    assert sorted(rec["generate"]) == sorted(rec["graph_step"]) == sorted(batches)
    for row in [*rec["generate"].values(), rec["transformers"]]:
        assert finite(row["step_ms"]) and finite(row["first_call_step_ms"])
        assert set(row["seconds"]) == {"first_1", "second_1", f"first_{rec['plan']['output_len']}",
                                       f"second_{rec['plan']['output_len']}"}
    for b, row in rec["graph_step"].items():
        assert row["batch"] == int(b) and finite(row["ms_per_step"])
    table = (offline / "e2e_table.md").read_text()
    assert "| batch 1 |" in table and "transformers" in table and "--quick" in table


def test_a_table_of_quick_records_stays_out_of_the_doc(offline, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\n{BEGIN}\nold\n{END}\n")
    e2e("--table", "--records", str(offline), "--out", str(tmp_path), "--doc", str(doc))
    assert doc.read_text() == f"# B\n\n{BEGIN}\nold\n{END}\n"
    assert "| batch 1 |" in (tmp_path / "e2e_table.md").read_text()


def test_table_replaces_only_what_stands_between_the_markers(offline, tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    rec = json.loads((offline / "e2e_offline.json").read_text())
    (records / "e2e_offline.json").write_text(json.dumps(dict(rec, quick=False)))  # as a GPU run's record reads
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n\n{BEGIN}\nthe last table\n{END}\n\nafter\n")
    for _ in range(2):  # a second run replaces the first one's table
        e2e("--table", "--records", str(records), "--out", str(tmp_path), "--doc", str(doc))
        text = doc.read_text()
        head, rest = text.split(BEGIN)
        inside, tail = rest.split(END)
        assert head == "# B\n\nbefore\n\n" and tail == "\n\nafter\n"
        assert "the last table" not in inside and inside.count("| batch 1 |") == 1
