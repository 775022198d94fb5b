"""Deferred read-back: a plain step comes back from the runner before its samples reach the host, and
`StepOutput.resolve()` fills them. Steps that read logits on the host (logprobs) come back complete. Tokens are
the same whichever way a step comes back, and a failure of the read-back reaches the engine's caller."""

from __future__ import annotations

import threading

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.core.interfaces import PLACEHOLDER, ChunkInput, StepInput, StepOutput
from deepserve.model.batch import to_device

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[2 + (13 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate((5, 40, 17, 90))]


def make_llm(path, **kw) -> LLM:
    kw.setdefault("block_size", 128)
    return LLM(path, dtype="float32", accelerator="cpu", **kw)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Each prompt's greedy tokens, synchronous scheduling."""
    llm = make_llm(tiny_dir, async_scheduling=False)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)]


@pytest.fixture
def runner(tiny_dir):
    """A runner of its own (the tests below write the cache's pages directly, past the engine)."""
    return make_llm(tiny_dir).runner


def chunk(request_id, start, token_ids, params=GREEDY, page=0, **kw) -> ChunkInput:
    """A sampling chunk of a request that fits in one page of the cache, `page`."""
    return ChunkInput(request_id, start, tuple(token_ids), True, (page,), params, seed=1, **kw)


def spy_on(llm) -> list[tuple[bool, bool]]:
    """Record (came back pending, held placeholders) for each step with chunks that `llm`'s runner executes."""
    execute, seen = llm.runner.execute, []

    def spied(step: StepInput) -> StepOutput:
        out = execute(step)
        if step.chunks:
            seen.append((out.pending is not None, any(PLACEHOLDER in c.token_ids for c in step.chunks)))
        return out

    llm.runner.execute = spied
    return seen


def test_a_plain_step_fills_its_samples_only_when_resolved(runner, reference):
    prompt = PROMPTS[1]
    out = runner.execute(StepInput((chunk("a", 0, prompt),)))
    assert out.pending is not None and out.sampled == {}
    assert out.resolve() is out and out.sampled == {"a": reference[1][0]} and out.pending is None
    assert out.seconds > 0
    # the next decode step reads the token as a placeholder, filled on the device from the deferred samples
    out = runner.execute(StepInput((chunk("a", len(prompt), [PLACEHOLDER]),)))
    assert out.sampled == {}
    out.resolve()
    assert out.sampled == {"a": reference[1][1]}
    out.resolve()  # a second resolve changes nothing
    assert out.sampled == {"a": reference[1][1]}


def test_steps_that_read_logits_come_back_resolved(runner, reference):
    prompt = PROMPTS[1]
    with_logprobs = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    out = runner.execute(StepInput((chunk("a", 0, prompt, with_logprobs), chunk("b", 0, PROMPTS[0], page=1))))
    assert out.pending is None  # one request's logprobs make the whole step synchronous
    assert out.sampled == {"a": reference[1][0], "b": reference[0][0]} and set(out.logprobs) == {"a"}
    with_prompt_logprobs = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    out = runner.execute(StepInput((chunk("c", 0, prompt, with_prompt_logprobs, page=2,
                                          prompt_targets=tuple(prompt[1:])),)))
    assert out.pending is None
    assert out.sampled == {"c": reference[1][0]} and len(out.prompt_logprobs["c"]) == len(prompt) - 1


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_are_the_same_with_deferred_steps(tiny_dir, reference, async_scheduling):
    llm = make_llm(tiny_dir, async_scheduling=async_scheduling)
    seen = spy_on(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(pending for pending, _ in seen)
    if async_scheduling:
        assert any(placeholders for _, placeholders in seen), "decode steps ran on the previous step's samples"


class FailingReadBack:
    """Wraps `llm`'s runner so that the read-back of its step number `at_step` (from 0) raises."""

    def __init__(self, llm, at_step: int) -> None:
        self.execute, self.at_step, self.num_steps = llm.runner.execute, at_step, 0
        self.failed: list[int] = []
        self.masks = []  # every step's grammar masks, to release a runner left waiting on them
        llm.runner.execute = self

    def __call__(self, step: StepInput) -> StepOutput:
        if step.masks is not None:
            self.masks.append(step.masks)
        out = self.execute(step)
        n, self.num_steps = self.num_steps, self.num_steps + 1
        if n == self.at_step and out.pending is not None:
            def device_fault():
                raise RuntimeError("device fault while reading the samples back")

            out.pending = device_fault
            self.failed.append(n)
        return out

    def release(self) -> None:
        for masks in self.masks:
            if not masks.bitmask.done():
                masks.bitmask.set_exception(RuntimeError("released by the test"))


def shuts_down(llm, failing: FailingReadBack) -> bool:
    """Whether the engine's worker finishes its last step and stops: it hangs if a step waits for grammar masks
    that no one fills (the bound is generous: not a timing). A hung worker is released, so the session ends."""
    done = threading.Thread(target=llm.engine.shutdown, daemon=True)
    done.start()
    done.join(timeout=120)
    hung = done.is_alive()
    failing.release()
    done.join()
    return not hung


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_failed_read_back_reaches_the_caller(tiny_dir, async_scheduling):
    llm = make_llm(tiny_dir, async_scheduling=async_scheduling)
    failing = FailingReadBack(llm, at_step=2)
    with pytest.raises(RuntimeError, match="device fault while reading the samples back"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert failing.failed == [2]
    assert shuts_down(llm, failing)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=0)


def test_a_failed_read_back_does_not_leave_a_grammar_step_waiting(demo_dir):
    # the step launched after the failing one waits for its grammar masks, which the engine fills only after it
    # has applied the failing step's samples: the error must reach that step too
    llm = make_llm(demo_dir, async_scheduling=True)
    failing = FailingReadBack(llm, at_step=0)
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": r"[a-z]{10,20}"})
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate(["spell a long word"], params, use_tqdm=False)
    assert failing.failed == [0]
    assert shuts_down(llm, failing)


@pytest.mark.parametrize("values, dtype", [
    ([3, 1, 4], torch.long), ([[0, 5], [2, 7]], torch.long), ([1, 2], torch.float32), ([], torch.long),
    (torch.tensor([9, 8], dtype=torch.int32), torch.int32), (torch.tensor([1, 255], dtype=torch.uint8), torch.uint8),
])
def test_to_device_gives_the_values_and_dtype_on_the_cpu(values, dtype):
    moved = to_device(values, dtype, "cpu")
    assert moved.dtype == dtype and moved.device.type == "cpu"
    assert torch.equal(moved, torch.as_tensor(values, dtype=dtype))
    assert moved.tolist() == (values.tolist() if isinstance(values, torch.Tensor) else values)
