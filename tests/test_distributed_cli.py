"""`deepserve serve`'s scale-out flags (vLLM's names) reach the engine options; impossible ones are one clear
error before anything starts."""

from __future__ import annotations

from deepserve.cli import build_parser, engine_options, main


def options(*flags: str) -> dict:
    return engine_options(build_parser().parse_args(["serve", *flags]))


def test_scale_out_flags_become_engine_options():
    got = options("--data-parallel-size", "4", "--enable-expert-parallel", "--data-parallel-size-local", "2",
                  "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1",
                  "--data-parallel-rpc-port", "13345", "--num-redundant-experts", "4")
    assert {k: got[k] for k in ("data_parallel_size", "enable_expert_parallel", "data_parallel_size_local",
                                "data_parallel_start_rank", "data_parallel_address", "data_parallel_rpc_port",
                                "num_redundant_experts")} == {
        "data_parallel_size": 4, "enable_expert_parallel": True, "data_parallel_size_local": 2,
        "data_parallel_start_rank": 2, "data_parallel_address": "10.0.0.1", "data_parallel_rpc_port": 13345,
        "num_redundant_experts": 4}
    assert "data_parallel_size" not in options() and "enable_expert_parallel" not in options()
    eplb = options("--enable-expert-parallel", "--enable-eplb", "--eplb-window-size", "10", "--eplb-step-interval", "50")
    assert (eplb["enable_eplb"], eplb["eplb_window_size"], eplb["eplb_step_interval"]) == (True, 10, 50)


def test_tensor_parallelism_is_refused_with_the_reason(capsys):
    assert main(["serve", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "one KV head" in err and "data_parallel_size" in err


def test_a_multi_node_rank_set_without_a_port_is_refused(capsys):
    assert main(["serve", "--headless", "--data-parallel-size", "4", "--data-parallel-size-local", "2",
                 "--enable-expert-parallel"]) == 2
    assert "data_parallel_rpc_port" in capsys.readouterr().err
