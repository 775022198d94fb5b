import pytest
import torch

from deepserve.sampling import (
    compute_logprobs,
    mix64,
    row_keys,
    sample,
    suppress_tokens,
    top_logprobs,
    uniform_noise,
)

torch.set_num_threads(1)


def run(logits, seeds, positions, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Sample with one set of parameters for every row; `logits` [V] is broadcast to all rows."""
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    b = seeds.shape[0]
    if logits.dim() == 1:
        logits = logits.expand(b, -1).contiguous()
    full = lambda v, dt: torch.full((b,), v, dtype=dt)  # noqa: E731
    return sample(
        logits,
        full(temperature, torch.float32),
        full(top_k, torch.int64),
        full(top_p, torch.float32),
        full(min_p, torch.float32),
        seeds,
        torch.as_tensor(positions, dtype=torch.int64).expand(b),
    )


def splitmix64_finalizer(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_hash_wraps_like_unsigned_64_bit_arithmetic():
    values = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321012345]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g % 2**64 for g in got] == [splitmix64_finalizer(v) for v in values]


def test_rows_do_not_depend_on_batch_composition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.9])
    top_k = torch.tensor([0, 5, 0, 0, 10, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.1])
    seeds = torch.tensor([11, 12, 13, 14, 15, 11])
    positions = torch.tensor([3, 4, 5, 6, 7, 9])
    args = (temperature, top_k, top_p, min_p, seeds, positions)
    alone = torch.cat([sample(logits[i : i + 1], *(a[i : i + 1] for a in args)) for i in range(6)])
    batched = sample(logits, *args)
    perm = torch.tensor([4, 1, 5, 0, 3, 2])
    permuted = sample(logits[perm], *(a[perm] for a in args))
    assert torch.equal(batched, alone)
    assert torch.equal(permuted, batched[perm])
    # the same (seed, position) in a bigger batch among other rows
    extra = torch.randn(3, 50, generator=g)
    bigger = sample(
        torch.cat([extra, logits]),
        *(torch.cat([a[:3], a]) for a in (temperature, top_k, top_p, min_p)),
        torch.cat([torch.tensor([99, 98, 97]), seeds]),
        torch.cat([torch.tensor([0, 1, 2]), positions]),
    )
    assert torch.equal(bigger[3:], batched)


def test_same_seed_and_position_repeat_and_others_differ():
    logits = torch.zeros(1000)  # uniform: every draw is pure noise
    a = run(logits, list(range(64)), 7)
    assert torch.equal(a, run(logits, list(range(64)), 7))
    assert len(set(a.tolist())) > 55  # different seeds, same position
    by_position = torch.cat([run(logits, [5], p) for p in range(64)])
    assert len(set(by_position.tolist())) > 55  # same seed, different positions
    assert not torch.equal(a, run(logits, list(range(64)), 8))


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([0.0, 1.0, 3.0, -2.0, 3.0, 3.0])
    assert run(logits, range(20), 0, temperature=0.0).tolist() == [2] * 20
    assert run(logits, range(20), 0, top_k=1).tolist() == [2] * 20
    wide = torch.zeros(2, 70000)
    wide[:, [40000, 123, 69999]] = 5.0
    assert run(wide, [0, 1], 0, temperature=0.0).tolist() == [123, 123]


def test_greedy_rows_are_argmax_lowest():
    """The runner's all-greedy shortcut (`argmax_lowest` instead of `sample`) draws what `sample` draws."""
    from deepserve.sampling import argmax_lowest

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (16, 300), generator=g).float()  # many ties
    assert torch.equal(run(logits, range(16), 0, temperature=0.0), argmax_lowest(logits))


PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize(
    "kwargs, allowed",
    [
        (dict(top_k=2), {1, 3}),
        (dict(top_k=3), {1, 2, 3}),
        (dict(top_p=0.75), {1, 3}),  # 0.5 < 0.75, 0.5 + 0.3 reaches it
        (dict(top_p=0.85), {1, 2, 3}),
        (dict(top_p=0.2), {1}),
        (dict(min_p=0.25), {1, 2, 3}),  # threshold 0.125
        (dict(min_p=0.5), {1, 3}),  # threshold 0.25
        (dict(top_k=3, top_p=0.6), {1, 3}),
        (dict(top_p=0.9, min_p=0.4), {1, 3}),
    ],
)
def test_filters_never_select_a_filtered_token(kwargs, allowed):
    seeds = list(range(600))
    tokens = set(run(PROBS.log(), seeds, 3, **kwargs).tolist())
    assert tokens == allowed  # never outside, and every kept token does occur


def test_filters_on_random_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(400, 300, generator=g) * 3
    out = run(logits, list(range(400)), 1, top_k=7)
    top7 = logits.topk(7, dim=-1).indices
    assert (top7 == out.unsqueeze(1)).any(dim=1).all()
    probs = torch.softmax(logits, dim=-1)
    out = run(logits, list(range(400)), 1, min_p=0.2)
    chosen = probs.gather(1, out.unsqueeze(1)).squeeze(1)
    assert (chosen >= 0.2 * probs.max(dim=-1).values).all()


def empirical(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_empirical_distribution_matches_probabilities():
    probs = torch.tensor([0.2, 0.3, 0.5])
    over_seeds = empirical(run(probs.log(), list(range(4000)), 17), 3)
    assert torch.allclose(over_seeds, probs.double(), atol=0.03)
    over_positions = empirical(torch.cat([run(probs.log() + 4.0, [3], p) for p in range(4000)]), 3)
    assert torch.allclose(over_positions, probs.double(), atol=0.03)


def test_temperature_sharpens_and_flattens():
    probs = torch.tensor([0.2, 0.8])
    for t in (0.5, 2.0):
        want = probs**(1 / t) / (probs**(1 / t)).sum()
        got = empirical(run(probs.log(), list(range(4000)), 0, temperature=t), 2)
        assert torch.allclose(got, want.double(), atol=0.03)


def test_logprobs_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 5.0]])
    lp = compute_logprobs(logits.to(torch.bfloat16))
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(2))
    values, ids, ranks = top_logprobs(lp, torch.tensor([2, 0]), 2)
    assert ids.tolist() == [[2, 1, 3], [0, 3, 0]]
    assert ranks.tolist() == [3, 2]
    assert torch.equal(values, lp.gather(1, ids))
    values, ids, ranks = top_logprobs(lp, torch.tensor([1, 3]), 0)
    assert ids.tolist() == [[1], [3]] and ranks.tolist() == [1, 1] and values.shape == (2, 1)


def test_suppressed_tokens_are_never_sampled():
    logits = torch.tensor([0.0, 10.0, 0.0]).expand(300, -1).contiguous()
    rows = torch.arange(300)
    masked = suppress_tokens(logits, rows, torch.ones(300, dtype=torch.int64))
    assert logits[0, 1] == 10.0  # input untouched
    assert 1 not in run(masked, list(range(300)), 0).tolist()
    assert run(masked[:1], [0], 0, temperature=0.0).tolist() == [0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 5000, generator=g)
    b = logits.shape[0]
    args = (
        torch.rand(b, generator=g) + 0.3,
        torch.randint(0, 50, (b,), generator=g),
        torch.rand(b, generator=g) * 0.5 + 0.5,
        torch.rand(b, generator=g) * 0.1,
        torch.randint(-(2**62), 2**62, (b,), generator=g),
        torch.randint(0, 10**6, (b,), generator=g),
    )
    noise = uniform_noise(row_keys(args[4], args[5]), 5000)
    assert torch.equal(uniform_noise(row_keys(args[4].cuda(), args[5].cuda()), 5000).cpu(), noise)  # bit-exact
    cpu = sample(logits, *args)
    cuda = sample(logits.cuda(), *(a.cuda() for a in args)).cpu()
    # fp32 softmax/cumsum may round differently at a filter edge, so allow a rare disagreement
    assert (cpu == cuda).float().mean() >= 0.95
