"""Expert parallelism in one process: the placement table, the loader's expert selection, the combine order
(bit-identical to the reference backend's `moe_experts`), the built-in all-to-all transport on a one-rank gloo
group, and the options refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.config import EngineConfig
from deepserve.core.env import default_model_dir
from deepserve.core.plugins import collect_registrations, make_plugin_manager
from deepserve.distributed.expert_parallel import attach, load_expert_parallel_model, moe_sites, rank_experts
from deepserve.distributed.placement import ExpertPlacement, PlacementError, site_index
from deepserve.model.loader import read_checkpoint
from deepserve.model.moe import combine_in_expert_order, expert_rows

from test_loader import to_official

MODEL = Path(default_model_dir())
#: the embedded model's MoE sites: one per decoder layer, then one per MTP block (v1 has 6 + 1, v2 8 + 1)
_CONFIG = json.loads((MODEL / "config.json").read_text())
NUM_DECODER_SITES = _CONFIG["num_hidden_layers"]
NUM_SITES = NUM_DECODER_SITES + _CONFIG.get("num_nextn_predict_layers", 0)
NUM_HASH_SITES = _CONFIG.get("num_hash_layers", 0)


# -- the placement table ----------------------------------------------------------------------------------------
def test_uniform_placement_with_redundant_slots():
    p = ExpertPlacement.uniform(num_sites=2, num_logical=8, world_size=2, num_redundant=2)
    assert p.num_physical == 10 and p.num_local == 5
    assert p.local_experts(0, 0) == [0, 1, 2, 3, 4] and p.local_experts(0, 1) == [5, 6, 7, 0, 1]
    assert p.logcnt[0].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert p.log2phy[0, 0].tolist() == [0, 8] and p.log2phy[0, 7].tolist() == [7, -1]


def test_replicas_share_the_tokens_of_their_expert():
    p = ExpertPlacement.uniform(1, 8, 2, num_redundant=2)
    ids = torch.tensor([[0, 5]] * 4)
    slots = p.physical(0, ids)
    assert slots[:, 0].tolist() == [0, 8, 0, 8]  # expert 0 alternates between its two slots by token row
    assert slots[:, 1].tolist() == [5, 5, 5, 5]
    assert (p.phy2log[0][slots] == ids).all()


@pytest.mark.parametrize("table, world, message", [
    ([[0, 1, 2]], 2, "do not divide over 2 ranks"),
    ([[0, 1, 1, 2]], 2, "logical expert(s) [3] are held by no physical slot"),
    ([[0, 1, 2, 9]], 2, "outside [0, 4)"),
])
def test_impossible_placements_are_refused(table, world, message):
    with pytest.raises(PlacementError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ExpertPlacement.from_phy2log(table, num_logical=4, world_size=world)


def test_redundant_count_that_does_not_divide_is_refused():
    with pytest.raises(PlacementError, match=r"8 routed experts \+ 1 redundant = 9 physical experts do not divide"):
        ExpertPlacement.uniform(1, 8, 2, num_redundant=1)


def test_site_names():
    assert site_index("model.layers.3.mlp", 6) == 3
    assert site_index("model.layers.3.mlp.experts", 6) == 3
    assert site_index("mtp.0.mlp.experts", 6) == 6
    assert site_index("model.layers.3.self_attn", 6) is None


# -- the loader reads only this rank's experts -------------------------------------------------------------------
@pytest.fixture(scope="module")
def official_dir(tmp_path_factory) -> Path:
    """The embedded model in the official per-expert spelling, with expert 5's tensors of a wrong shape: a load
    that reads expert 5 fails, one that skips it does not."""
    state = read_checkpoint(MODEL, progress=False)
    tensors = to_official(state)
    for name in [n for n in tensors if ".ffn.experts.5." in n]:
        tensors[name] = torch.zeros(3, 3)
    path = tmp_path_factory.mktemp("official")
    shutil.copy(MODEL / "config.json", path / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def test_stacked_checkpoint_reads_the_selected_rows_in_slot_order():
    full = read_checkpoint(MODEL, progress=False)
    part = read_checkpoint(MODEL, progress=False, experts=lambda prefix: [3, 1, 3])
    name = "model.layers.2.mlp.experts.gate_up_proj"
    assert torch.equal(part[name], full[name][[3, 1, 3]])
    assert torch.equal(part["mtp.0.mlp.experts.down_proj"], full["mtp.0.mlp.experts.down_proj"][[3, 1, 3]])
    assert torch.equal(part["model.embed_tokens.weight"], full["model.embed_tokens.weight"])


def test_per_expert_checkpoint_never_stacks_other_ranks_experts(official_dir):
    full = read_checkpoint(MODEL, progress=False)
    with pytest.raises(Exception):
        read_checkpoint(official_dir, progress=False)  # expert 5 is unusable
    part = read_checkpoint(official_dir, progress=False, experts=lambda prefix: [0, 7, 0, 2])
    for leaf in ("gate_up_proj", "down_proj"):
        name = f"model.layers.4.mlp.experts.{leaf}"
        assert torch.equal(part[name], full[name][[0, 7, 0, 2]])


# -- the combine order -------------------------------------------------------------------------------------------
def test_combine_gives_the_reference_moe_bits():
    torch.manual_seed(0)
    backend = ReferenceBackend("cpu")
    T, k, E, D, I = 9, 3, 6, 16, 8
    x = torch.randn(T, D)
    w13, w2 = torch.randn(E, 2 * I, D) / 4, torch.randn(E, D, I) / 3
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    expected = backend.moe_experts(x, ids, weights, w13, w2, 7.0)
    pairs = expert_rows(backend, x.repeat_interleave(k, 0), ids.reshape(-1), w13, w2, 7.0).view(T, k, D)
    assert torch.equal(combine_in_expert_order(pairs, ids, weights, x.dtype), expected)


# -- the transport on a one-rank group, and a model wired to it ---------------------------------------------------
@pytest.fixture()
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_expert_parallel_model_on_one_rank_gives_the_single_process_logits(one_rank_group):
    from deepserve.model.factory import load_model

    backend = ReferenceBackend("cpu")
    reference = load_model(MODEL, backend, "float32", progress=False)
    placement = ExpertPlacement.from_phy2log([[7, 6, 5, 4, 3, 2, 1, 0, 2, 5]] * NUM_SITES, num_logical=8,
                                             world_size=1)
    model = load_expert_parallel_model(MODEL, backend, "float32", placement, rank=0)
    transport = collect_registrations(make_plugin_manager(False), "deepserve_register_expert_transports")[
        "all_to_all"](one_rank_group, placement, rank_experts(model, backend))
    attach(model, placement, transport)
    assert moe_sites(model)[0].experts.gate_up_proj.shape[0] == 10
    torch.manual_seed(1)
    x = torch.randn(5, model.cfg.hidden_size)
    token_ids = torch.randint(0, model.cfg.vocab_size, (5,))
    for site in (0, NUM_HASH_SITES, NUM_SITES - 1):  # a hash layer, the first routed one, the MTP block's
        got = moe_sites(model)[site](x, token_ids)
        want = moe_sites(reference)[site](x, token_ids)
        assert torch.equal(got, want), site
    rounds = transport.num_rounds
    transport.finish_step()  # alone in the world: one round in which nobody is active ends it
    assert transport.num_rounds == rounds + 1


# -- options refused at start ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    ({"tensor_parallel_size": 2}, "one KV head"),
    ({"data_parallel_size": 2, "data_parallel_start_rank": 1, "data_parallel_size_local": 2,
      "data_parallel_rpc_port": 5000}, "exceeds data_parallel_size 2"),
    ({"data_parallel_size": 4, "data_parallel_size_local": 2}, "need data_parallel_rpc_port"),
    ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1"),
    ({"data_parallel_size": 2, "data_parallel_size_local": -1}, "data_parallel_size_local must be an integer >= 0"),
    ({"num_redundant_experts": 2}, "need enable_expert_parallel"),
    ({"enable_eplb": True}, "need enable_expert_parallel"),
    ({"enable_expert_parallel": True, "enable_eplb": True, "data_parallel_size": 2, "num_redundant_experts": 3},
     "must be a multiple of data_parallel_size"),
    ({"enable_expert_parallel": True, "eplb_step_interval": 0}, "eplb_step_interval must be a positive integer"),
])
def test_impossible_scale_out_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(MODEL), **options)


def test_nccl_without_gpus_is_refused(monkeypatch):
    from deepserve.distributed.launch import dist_backend

    monkeypatch.setenv("DEEPSERVE_DIST_BACKEND", "nccl")
    if torch.cuda.is_available():
        assert dist_backend(None) == "nccl"
    else:
        with pytest.raises(ValueError, match="nccl needs CUDA GPUs"):
            dist_backend(None)
    monkeypatch.setenv("DEEPSERVE_DIST_BACKEND", "mpi")
    with pytest.raises(ValueError, match="must be one of"):
        dist_backend(None)


def test_expert_count_that_does_not_divide_is_refused_before_any_rank_starts():
    from deepserve import LLM

    with pytest.raises(PlacementError, match="do not divide over 3 ranks"):
        LLM(MODEL, data_parallel_size=3, enable_expert_parallel=True)


def test_a_placement_file_for_the_decoder_layers_gets_static_mtp_rows(tmp_path):
    from deepserve.build import expert_placement

    table = tmp_path / "phy2log.json"
    table.write_text(json.dumps([[1, 0, 3, 2, 5, 4, 7, 6]] * NUM_DECODER_SITES))
    p = expert_placement(EngineConfig(model=str(MODEL), data_parallel_size=2, enable_expert_parallel=True,
                                      expert_placement=str(table)), 2)
    assert p.num_sites == NUM_SITES and p.local_experts(0, 1) == [5, 4, 7, 6]
    assert p.local_experts(NUM_SITES - 1, 0) == [0, 1, 2, 3]  # the MTP block's site: the static placement


def test_the_transport_and_router_hooks_register_the_built_ins():
    pm = make_plugin_manager(False)
    assert "all_to_all" in collect_registrations(pm, "deepserve_register_expert_transports")
    assert "least_loaded" in collect_registrations(pm, "deepserve_register_dp_routers")


def test_our_table_is_a_balance_placement_value_and_back():
    from deepserve.distributed.eplb import as_balance_placement

    ours = ExpertPlacement.from_phy2log([[3, 0, 1, 3, 2, 0]] * 2, num_logical=4, world_size=2)
    value = as_balance_placement(ours)  # deepserve.core.balance validates the three arrays against each other
    assert value.logcnt[0] == (2, 1, 1, 2) and value.log2phy[0][3] == (0, 3) and value.log2phy[0][1] == (2, -1)
    back = ExpertPlacement.from_phy2log(value.phy2log, 4, 2)
    assert torch.equal(back.phy2log, ours.phy2log)


def test_torchrun_environment_gives_the_rank_and_must_match_the_world():
    from deepserve.distributed.launch import torchrun_context

    config = EngineConfig(model=str(MODEL), data_parallel_size=2, enable_expert_parallel=True,
                          data_parallel_rpc_port=13345, data_parallel_address="10.0.0.1")
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    context = torchrun_context(config, env)
    assert (context.rank, context.world_size, context.local_index) == (1, 2, 1)
    assert context.front_endpoint == "tcp://10.0.0.1:13345" and context.dist_init_method == "env://"
    assert torchrun_context(config, {}) is None
    with pytest.raises(ValueError, match="torchrun started a world of 4 processes but data_parallel_size is 2"):
        torchrun_context(config, {**env, "WORLD_SIZE": "4"})
