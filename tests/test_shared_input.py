"""Projections that read the same input run as one GEMM (`deepserve.model.common.SharedInput`): each member still
returns what its own GEMM would, whatever order or inputs it is called with; the model groups them at load."""

from __future__ import annotations

import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.model.common import linear, share_input

torch.set_num_threads(1)


def _members(n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    backend = ReferenceBackend("cpu")
    layers = [linear(backend, 16, w) for w in (8, 4, 12)[:n]]
    for m in layers:
        m.weight.data = torch.randn(m.weight.shape, generator=g)
    expect = [m.weight.detach().clone() for m in layers]
    return backend, layers, expect


def test_members_return_their_own_projection_in_any_order_and_on_any_input():
    backend, layers, weights = _members()
    group = share_input(backend, layers)
    assert group is not None and group.weight.shape == (24, 16)
    for m, w in zip(layers, weights):
        assert m.weight.data_ptr() != w.data_ptr() and torch.equal(m.weight, w)
    x, y = torch.randn(5, 16), torch.randn(2, 3, 16)
    for order in ([0, 1, 2], [2, 0, 1], [1, 1, 0, 2]):  # a member asked twice for one input is recomputed
        for i in order:
            assert torch.allclose(layers[i](x), x @ weights[i].t(), atol=1e-5)
    a = layers[0](x)
    b = layers[1](y)  # another input before the group finished with x
    c = layers[2](x)
    assert torch.allclose(a, x @ weights[0].t(), atol=1e-5)
    assert b.shape == (2, 3, 4) and torch.allclose(b, y @ weights[1].t(), atol=1e-5)
    assert torch.allclose(c, x @ weights[2].t(), atol=1e-5)


def test_loading_into_a_member_writes_the_stacked_weight():
    backend, layers, _ = _members()
    group = share_input(backend, layers)
    new = torch.randn(4, 16)
    with torch.no_grad():
        layers[1].weight.copy_(new)
    assert torch.equal(group.weight[8:12], new)
    x = torch.randn(3, 16)
    assert torch.allclose(layers[1](x), x @ new.t(), atol=1e-5)


def test_what_cannot_be_stacked_is_left_alone():
    backend, layers, _ = _members(2)
    layers[1].weight.data = layers[1].weight.data.double()
    assert share_input(backend, layers) is None and all(m.shared is None for m in layers)
    assert share_input(backend, layers[:1]) is None
    backend, layers, _ = _members(2)
    assert share_input(backend, layers) is not None
    assert share_input(backend, layers) is None  # already grouped


def test_loaded_model_groups_its_projections_and_matches_the_ungrouped_model(tmp_path):
    from deepserve.model.batch import make_batch
    from deepserve.model.factory import build_model, load_model
    from deepserve.model.loader import load_weights, read_checkpoint, read_config
    from deepserve.model.writer import save_checkpoint
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path / "demo", seed=3)
    backend = ReferenceBackend("cpu")
    grouped = load_model(path, backend, dtype="float32", progress=False)
    plain = build_model(read_config(path), backend, torch.float32)
    load_weights(plain, read_checkpoint(path, dtype=torch.float32, device="cpu", progress=False))
    assert sum(1 for m in grouped.modules() if getattr(m, "shared", None) is not None) > 0
    assert all(layer.self_attn.q_a_proj.shared is not None for layer in grouped.model.layers)
    assert grouped.share_projection_inputs() == 0  # once only
    prompts = [list(range(3, 40)), list(range(7, 30))]
    states_g = [grouped.make_state() for _ in prompts]
    states_p = [plain.make_state() for _ in prompts]
    out_g = grouped(make_batch(prompts, [0, 0], "cpu"), states_g).logits
    out_p = plain(make_batch(prompts, [0, 0], "cpu"), states_p).logits
    assert torch.allclose(out_g, out_p, atol=1e-4, rtol=1e-4)
    for step in range(20):  # decode across compression boundaries
        starts = [len(p) + step for p in prompts]
        toks = [[int(out_g[i].argmax())] for i in range(2)]
        out_g = grouped(make_batch(toks, starts, "cpu"), states_g).logits
        out_p = plain(make_batch(toks, starts, "cpu"), states_p).logits
        assert torch.allclose(out_g, out_p, atol=1e-4, rtol=1e-4)
    # the writer saves the stacked views as separate tensors that load back the same
    again = load_model(save_checkpoint(grouped, tmp_path / "again"), backend, dtype="float32", progress=False)
    for (name, a), (_, b) in zip(grouped.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
