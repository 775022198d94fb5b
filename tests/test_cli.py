"""The `deepserve` command line."""

from __future__ import annotations

import json

from deepserve.cli import main


def test_generate_prints_one_json_line_per_prompt(tmp_path, capsys):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    model = build_demo_checkpoint(tmp_path / "demo")
    assert main(["generate", "--model", str(model), "--accelerator", "cpu", "--max-tokens", "5", "a", "bc"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["a", "bc"] and all(len(x["token_ids"]) <= 5 for x in lines)


def test_plugins_lists_the_builtin_backends(capsys):
    assert main(["plugins", "--builtin-only"]) == 0
    out = capsys.readouterr().out
    assert "deepserve.backends.reference.plugin" in out and "deepserve_select_backend" in out


def test_bad_input_is_one_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--accelerator", "cpu", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cuda_graph_sizes_and_batch_invariant_flags_become_engine_options():
    from deepserve.cli import build_parser, engine_options

    def options(*flags):
        return engine_options(build_parser().parse_args(["serve", *flags]))

    got = options("--cuda-graph-sizes", "1", "8", "64", "--batch-invariant")
    assert got["cuda_graph_sizes"] == [1, 8, 64] and got["batch_invariant"] is True
    plain = options()
    assert "cuda_graph_sizes" not in plain and "batch_invariant" not in plain  # the config's defaults, the env
