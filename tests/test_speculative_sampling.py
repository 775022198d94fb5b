"""Sampled speculative decoding keeps the target distribution: chi-square tests with fixed seeds, on the
rejection rule itself (small vocabulary, known p and q) and end to end through the engine (top-k 3, so the
target's joint distribution of two tokens has 9 cells computed exactly from the model). A deliberately wrong
rule fails the same test, so the bound can fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepserve
from deepserve import LLM, SamplingParams
from deepserve.backends.reference import ReferenceBackend
from deepserve.model.speculative import RowSampling
from deepserve.model.verify import verify

# chi-square critical values at p = 0.001 (the fixed seeds make every test deterministic)
CHI2_CRIT_001 = {2: 13.82, 5: 20.52, 8: 26.12}

P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03],   # target at row 0 (checks draft 1)
                  [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],   # row 1 (checks draft 2)
                  [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]])  # bonus row
Q = torch.tensor([[0.10, 0.10, 0.10, 0.10, 0.30, 0.30],   # the drafter's distribution for draft 1
                  [0.40, 0.30, 0.10, 0.10, 0.05, 0.05]])  # and for draft 2


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def run_rule(n: int, claimed_q: torch.Tensor | None = None):
    """n sequences with 2 drafts each drawn from Q; returns (num kept, token after them, drafts)."""
    g = torch.Generator().manual_seed(1234)
    drafts = torch.stack([torch.multinomial(Q[j], n, replacement=True, generator=g) for j in range(2)], 1)
    logits = P.log().repeat(n, 1)
    q = (Q if claimed_q is None else claimed_q)
    probs = torch.cat([q, torch.zeros(1, 6)]).repeat(n, 1)
    draft_ids = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1).reshape(-1)
    rows = 3 * n
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    sampling = RowSampling(ones, zeros.long(), ones, zeros, torch.arange(n).repeat_interleave(3) * 7919 + 5)
    positions = torch.tensor([40, 41, 42]).repeat(n)
    kept, token = verify(ReferenceBackend("cpu"), logits, sampling, positions, [2] * n, draft_ids, probs)
    return kept, token, drafts


def emitted(kept, token, drafts):
    """The first and second tokens the sequences emit (second only where the first was a kept draft)."""
    first = torch.where(kept >= 1, drafts[:, 0], token)
    has_second = kept >= 1
    second = torch.where(kept >= 2, drafts[:, 1], token)[has_second]
    return first, second


def test_the_rejection_rule_keeps_the_target_distribution():
    n = 6000
    kept, token, drafts = run_rule(n)
    first, second = emitted(kept, token, drafts)
    assert chi_square(torch.bincount(first, minlength=6).float(), P[0]) < CHI2_CRIT_001[5]
    assert chi_square(torch.bincount(second, minlength=6).float(), P[1]) < CHI2_CRIT_001[5]
    # the acceptance rate of draft 1 is sum_v min(p, q) (here 0.5), within 5 standard errors
    rate = float((kept >= 1).float().mean())
    expected = float(torch.minimum(P[0], Q[0]).sum())
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / n) ** 0.5
    bonus = token[kept == 2]  # all kept: the bonus token is drawn from the bonus row
    assert chi_square(torch.bincount(bonus, minlength=6).float(), P[2]) < CHI2_CRIT_001[5]


def test_a_wrong_rule_fails_the_same_bound():
    """Claiming q = p makes the verifier keep every draft: the output is then Q's distribution, and the
    chi-square test catches it."""
    kept, token, drafts = run_rule(6000, claimed_q=P[:2])
    first, _ = emitted(kept, token, drafts)
    assert chi_square(torch.bincount(first, minlength=6).float(), P[0]) > 10 * CHI2_CRIT_001[5]


def test_greedy_rows_keep_exactly_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0], [1.0, 1.0, 0.0]])
    zeros = torch.zeros(4)
    sampling = RowSampling(zeros, zeros.long(), torch.ones(4), zeros, zeros.long())
    # sequence A: drafts 1, 1 (first right, second wrong: argmax of row 1 is 0); sequence B: no drafts
    kept, token = verify(ReferenceBackend("cpu"), logits, sampling, torch.arange(4), [2, 0],
                         torch.tensor([1, 1, 0, 0]), None)
    assert kept.tolist() == [1, 0] and token.tolist() == [0, 0]  # B: argmax of [1, 1, 0] is the lowest id


@pytest.mark.parametrize("method", ["mtp"])
@torch.inference_mode()
def test_engine_samples_keep_the_targets_joint_distribution(method):
    from deepserve.sampling import filter_logits
    from deepserve.model.batch import make_batch

    path = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
    llm = LLM(path, dtype="float32", accelerator="cpu", load_plugins=False, block_size=128,
              speculative_config={"method": method, "num_speculative_tokens": 3})
    prompt = [60, 61, 62, 63, 64, 65, 66, 67]
    n = 600
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    verified, accepted = sum(o.num_verified_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)
    assert 0 < accepted < verified  # second tokens came from kept drafts and from rejections

    def target(ids):
        state = llm.model.make_state()
        logits = llm.model(make_batch([ids], [0], "cpu"), [state]).logits
        one = torch.ones(1)
        return torch.softmax(filter_logits(logits, one, torch.tensor([3]), one, torch.zeros(1)), -1)[0]

    p1 = target(prompt)
    firsts = torch.nonzero(p1).flatten().tolist()
    cells, probs = [], []
    for a in firsts:
        p2 = target(prompt + [a])
        for b in torch.nonzero(p2).flatten().tolist():
            cells.append((a, b))
            probs.append(float(p1[a] * p2[b]))
    assert len(cells) == 9 and set(pairs) <= set(cells)
    observed = torch.tensor([float(pairs.count(c)) for c in cells])
    assert chi_square(observed, torch.tensor(probs)) < CHI2_CRIT_001[8]
