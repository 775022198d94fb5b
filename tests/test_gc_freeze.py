"""The engine freezes the garbage collector's heap once built (`gc.freeze`, DEEPSERVE_GC_FREEZE) and gives it back
when it shuts down, so a full collection during serving walks only what requests allocate."""

from __future__ import annotations

import gc

from deepserve import LLM, SamplingParams
from deepserve.core.env import gc_freeze_wanted


def test_variable_parsing():
    assert gc_freeze_wanted({})
    assert gc_freeze_wanted({"DEEPSERVE_GC_FREEZE": "1"})
    for off in ("0", "false", " Off ", "no"):
        assert not gc_freeze_wanted({"DEEPSERVE_GC_FREEZE": off})


def test_engine_freezes_its_heap_and_unfreezes_on_shutdown(tiny_dir, monkeypatch):
    monkeypatch.delenv("DEEPSERVE_GC_FREEZE", raising=False)
    gc.unfreeze()
    llm = LLM(str(tiny_dir), accelerator="cpu", max_num_seqs=2, max_model_len=64)
    try:
        assert gc.get_freeze_count() > 10_000
        runner = llm.engine.executor
        assert not any(o is runner for o in gc.get_objects()), "the engine's runner should be frozen"
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.engine.shutdown()
    assert gc.get_freeze_count() == 0
    llm.engine.shutdown()  # a second shutdown unfreezes nothing more


def test_variable_off_leaves_the_collector_alone(tiny_dir, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_GC_FREEZE", "0")
    gc.unfreeze()
    llm = LLM(str(tiny_dir), accelerator="cpu", max_num_seqs=2, max_model_len=64)
    try:
        assert gc.get_freeze_count() == 0
    finally:
        llm.engine.shutdown()
