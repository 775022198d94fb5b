"""`engram_device` (docs/v41.md, "Engram tables in host memory"): `LLM(..., engram_device="cpu")` and `deepserve
serve --engram-device cpu` keep a V4.1 checkpoint's Engram tables in host memory whatever device the model moves
to, with the same outputs; an unknown device, or the option on a checkpoint without Engram (V4), is an error that
says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepserve
from deepserve import LLM, SamplingParams
from deepserve.cli import build_parser, engine_options
from deepserve.core.config import EngineConfig
from test_v41_engine import TINY_A, prompt

V4_DIR = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)


def make_llm(**options) -> LLM:
    torch.set_num_threads(1)
    return LLM(model=str(TINY_A), block_size=128, max_num_seqs=2, **options)


def bits(out) -> list[tuple[int, float]]:
    c = out.outputs[0]
    return [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)]


def table_devices(model) -> list[str]:
    return [blk.engram.table.weight.device.type for blk in model.layers if blk.engram is not None]


def test_the_tables_stay_in_host_memory_with_the_same_outputs():
    ids = prompt(40, seed=31)
    placed, default = make_llm(engram_device="cpu"), make_llm()
    assert bits(placed.generate([ids], GREEDY, use_tqdm=False)[0]) == \
        bits(default.generate([ids], GREEDY, use_tqdm=False)[0])
    for llm in (placed, default):  # the engine's model moved elsewhere (here "meta": no GPU in this test)
        llm.model.to_device("meta")
    assert table_devices(placed.model) == ["cpu", "cpu"]  # tiny_a's two Engram layers
    assert table_devices(default.model) == ["meta", "meta"]
    assert placed.model.layers[0].attn.wq_a.dense.device.type == "meta"


def test_an_unknown_device_or_a_checkpoint_without_engram_is_refused():
    for bad in ("gpu", "cuda", ""):
        with pytest.raises(ValueError, match="engram_device must be 'cpu'"):
            EngineConfig(model=str(TINY_A), engram_device=bad)
    with pytest.raises(ValueError, match="has model_type 'deepseek_v4'"):
        LLM(model=str(V4_DIR), engram_device="cpu")


def test_serve_takes_engram_device():
    parser = build_parser()
    args = parser.parse_args(["serve", str(TINY_A), "--engram-device", "cpu"])
    assert engine_options(args)["engram_device"] == "cpu"
    assert "engram_device" not in engine_options(parser.parse_args(["serve", str(TINY_A)]))
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["serve", str(TINY_A), "--engram-device", "gpu"])
