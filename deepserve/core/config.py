"""Configuration value objects: the model's shape (read from `config.json`) and the engine's options.

`ModelConfig.from_dict` accepts the Hugging Face `DeepseekV4Config` fields, the legacy fields older V4
checkpoints ship (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`), and the official
reference's `ModelArgs` names (`dim`, `n_layers`, `n_heads`, `moe_inter_dim`, ...), so a checkpoint directory
from any of those sources loads without edits. Plain Python: no torch here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
SUPPORTED_ARCHITECTURES = ("DeepseekV4ForCausalLM",)


class ConfigError(ValueError):
    """A `config.json` that deepserve cannot serve; the message names the field and the problem."""


# official reference (`inference/model.py` ModelArgs) name -> HF field name
_OFFICIAL_TO_HF = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_hash_layers": "num_hash_layers",
    "rope_head_dim": "qk_rope_head_dim",
    "rope_factor": "_rope_factor",
    "original_seq_len": "_original_seq_len",
    "beta_fast": "_beta_fast",
    "beta_slow": "_beta_slow",
    "max_seq_len": "max_position_embeddings",
}
_RATIO_TO_TYPE = {0: SLIDING, 1: SLIDING}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One RoPE flavour: base `theta`, rotated dims, and the optional YaRN frequency ramp."""

    theta: float
    rotary_dim: int
    yarn_factor: float | None = None
    yarn_original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inv_freq(self) -> list[float]:
        """Inverse frequencies of the rotated pairs, YaRN-ramped where configured (equal to HF's)."""
        dim = self.rotary_dim
        base = [1.0 / (self.theta ** (i / dim)) for i in range(0, dim, 2)]
        if not self.yarn_factor or self.yarn_factor == 1.0:
            return base

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.yarn_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i, f in enumerate(base):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0 = keep, 1 = interpolate
            out.append(f / self.yarn_factor * ramp + f * (1.0 - ramp))
        return out


@dataclass(slots=True)
class ModelConfig:
    """The shape of a DeepSeek-V4 checkpoint. Field names follow Hugging Face's `DeepseekV4Config`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    num_nextn_predict_layers: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    quantization_config: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    #: routed expert slots this process holds under expert parallelism (deepserve/distributed); None: all
    #: `n_routed_experts`. Not a checkpoint field: set by the rank's loader, never read from config.json.
    num_local_experts: int | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"unknown attention layer type(s) {bad}; expected one of {list(LAYER_TYPES)}")
        bad = sorted({t for t in self.mlp_layer_types if t not in (HASH_MOE, MOE)})
        if bad:
            raise ConfigError(f"unknown mlp layer type(s) {bad}; expected 'hash_moe' or 'moe'")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not divisible by o_groups {self.o_groups}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ConfigError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and at most head_dim {self.head_dim}")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported (DeepSeek-V4 uses 'sqrtsoftplus')")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts must be 1 for DeepSeek-V4, got {self.n_shared_experts}")
        if CSA in self.layer_types and self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim {self.qk_rope_head_dim} exceeds index_head_dim {self.index_head_dim}: "
                              "the indexer rotates the last qk_rope_head_dim dims of its keys")
        for kind in (CSA, HCA):
            if kind in self.layer_types and self.compress_rates.get(kind, 0) <= 0:
                raise ConfigError(f"compress_rates[{kind!r}] must be a positive integer")

    def compress_rate(self, layer_type: str) -> int:
        return self.compress_rates[layer_type]

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        d = dict(data)
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported architecture: model_type {model_type!r} (deepserve serves {list(SUPPORTED_MODEL_TYPES)})"
            )
        if model_type is None and archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise ConfigError(
                f"unsupported architecture: {archs} (deepserve serves {list(SUPPORTED_ARCHITECTURES)})"
            )
        for official, hf in _OFFICIAL_TO_HF.items():
            if official in d and hf not in d:
                d[hf] = d[official]

        def need(name: str) -> Any:
            if name not in d or d[name] is None:
                raise ConfigError(f"config.json is missing the required field {name!r}")
            return d[name]

        n_layers = int(need("num_hidden_layers"))
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = int(d.get("head_dim") or hidden // heads)

        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = int(d["compress_rate_csa"])
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = int(d["compress_rate_hca"])

        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            ratio_to_type = dict(_RATIO_TO_TYPE)
            ratio_to_type[rates[CSA]] = CSA
            ratio_to_type[rates[HCA]] = HCA
            try:
                layer_types = [ratio_to_type[int(r)] for r in d["compress_ratios"]]
            except KeyError as exc:
                raise ConfigError(f"compress_ratios holds an unknown ratio {exc.args[0]}") from exc
        if layer_types is None:
            raise ConfigError("config.json has neither 'layer_types' nor 'compress_ratios'")
        layer_types = list(layer_types[:n_layers])  # legacy compress_ratios carry an extra MTP entry

        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(d.get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n_layers, n_hash) + [MOE] * max(0, n_layers - n_hash)
        mlp_types = list(mlp_types[:n_layers])

        if d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
        else:
            rope_dim = int(d.get("qk_rope_head_dim") or 64)
        main_rope, compress_rope = _rope_configs(d, rope_dim)

        eos = d.get("eos_token_id", 1)
        eos_ids = [int(e) for e in eos] if isinstance(eos, list) else ([] if eos is None else [int(eos)])
        experts = d.get("n_routed_experts", d.get("num_local_experts"))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            head_dim=head_dim,
            q_lora_rank=int(need("q_lora_rank")),
            qk_rope_head_dim=rope_dim,
            o_groups=int(d.get("o_groups", 8)),
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            sliding_window=int(d.get("sliding_window", 128)),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            compress_rates=rates,
            main_rope=main_rope,
            compress_rope=compress_rope,
            max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 512)),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            n_routed_experts=int(experts if experts is not None else need("n_routed_experts")),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or need("intermediate_size")),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 1)),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            quantization_config=d.get("quantization_config"),
            raw=data,
        )


def _rope_configs(d: dict[str, Any], rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """Resolve the `main` (window-only layers) and `compress` (CSA/HCA layers) RoPE flavours."""
    params = d.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_p, comp_p = params["main"], params["compress"]
    else:
        scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k not in ("main", "compress")}
        main_p = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
        comp_p = dict(scaling or {})
        comp_p["rope_theta"] = d.get("compress_rope_theta", 160000.0)
        if "_rope_factor" in d:  # official ModelArgs spelling
            comp_p.update(rope_type="yarn", factor=d["_rope_factor"],
                          original_max_position_embeddings=d.get("_original_seq_len", 65536),
                          beta_fast=d.get("_beta_fast", 32), beta_slow=d.get("_beta_slow", 1))
        comp_p.setdefault("rope_type", comp_p.get("type", "default"))

    def build(p: dict[str, Any], default_theta: float) -> RopeConfig:
        kind = p.get("rope_type", p.get("type", "default"))
        theta = float(p.get("rope_theta", default_theta))
        if kind == "default":
            return RopeConfig(theta=theta, rotary_dim=rope_dim)
        if kind != "yarn":
            raise ConfigError(f"rope_type {kind!r} is not supported (DeepSeek-V4 uses 'default' and 'yarn')")
        return RopeConfig(
            theta=theta,
            rotary_dim=rope_dim,
            yarn_factor=float(p["factor"]),
            yarn_original_max_position=int(p.get("original_max_position_embeddings", 65536)),
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
        )

    return build(main_p, 10000.0), build(comp_p, 160000.0)


DTYPES = ("auto", "float32", "bfloat16", "float16")
#: `quantization` (vLLM's flag): the checkpoint's quantization_config, DeepSeek's FP8 / FP4, or dequantized
QUANTIZATIONS = ("auto", "fp8", "none")
#: `kv_cache_dtype` (vLLM's flag): the model dtype, bf16, or DeepSeek's FP8 KV rows with FP4 indexer keys
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
#: `engram_device`: where a V4.1 checkpoint's Engram tables live: with the model (None) or in host memory
ENGRAM_DEVICES = (None, "cpu")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's shape: `{"method": "mtp" | "dspark", "num_speculative_tokens": 5}`.

    `method` names a proposer registered through `deepserve_register_proposers` (built-in: `mtp`, fixed-k
    verification of the MTP block's drafts; `dspark`, the same drafts with confidence-planned verify lengths).
    """

    method: str
    num_speculative_tokens: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative_config.method must be a non-empty string such as 'mtp' or 'dspark', "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in 1..16, got {k!r}")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From None, a `SpeculativeConfig`, a dict, or its JSON text (the CLI option and the environment)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict like {{\"method\": \"mtp\"}}, got {value!r}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; the fields are 'method' and "
                             "'num_speculative_tokens'")
        if "method" not in value:
            raise ValueError("speculative_config.method is required ('mtp' or 'dspark')")
        return cls(**value)


@dataclass(slots=True)
class EngineConfig:
    """Every option of one engine instance, in vLLM's names: what `LLM(model, **options)`,
    `AsyncEngine.from_pretrained(model, **options)` and `deepserve serve` take, validated here once. Hooks
    receive this object at start-up, and `deepserve.build.build_engine` builds an engine from it.

    - `model`: the checkpoint directory. `dtype`: `auto` (bf16 on accelerators, fp32 on CPU), `float32`,
      `bfloat16`, `float16`. `accelerator`: `auto` (the plugins decide), `cpu`, `nvidia`, `ascend` or a
      third-party backend's name; `device` optionally pins a torch device (`cuda:1`). `seed`: the engine's
      default sampling seed. `quantization` (vLLM's flag; docs/quantization.md): `auto` keeps the weights the
      checkpoint's `quantization_config` stores as FP8 / FP4 as stored, `fp8` DeepSeek's form (FP8 dense, FP4
      routed experts; a bf16 checkpoint is quantized at load), `none` dequantizes everything to `dtype`.
    - Scheduling: `max_model_len` (default the model's), `max_num_seqs`, `max_num_batched_tokens` (tokens per
      step), `step_time_target` (seconds the cost model sizes prefill chunks for), `async_scheduling` (plan step
      N+1 while N runs).
    - KV cache: `block_size` (tokens per page, a multiple of 128), `enable_prefix_caching`, `kv_cache_bytes`
      (else `gpu_memory_utilization` of the device's memory minus the weights on a GPU, 512 MiB on CPU).
      `kv_cache_dtype` (vLLM's flag; docs/quantization.md): `auto` the model dtype, `bf16`, or `fp8` (DeepSeek's
      reference precision: FP8 e4m3 non-RoPE dims with a power-of-two scale per 64, bf16 RoPE dims, FP4 indexer
      keys; the rows are rounded so today, stored at the model dtype).
    - Cache tiers below the GPU pages (docs/cache.md): `host_cache_bytes` (a host-memory LRU of blocks),
      `kv_store` (a block store by URI: `dir:///mnt/3fs/kv`, `redis://host:6379/0`, `ec:10+2:dir:///root`),
      `kv_store_deadline` (seconds a store call may take; past it, a miss), `kv_store_ttl_class` (`chat` or
      `agent`, the retention class of the blocks written). `kv_events_config`: vLLM's KV events for routers
      (`{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}`, a dict or its JSON; docs/cache.md).
      `swa_host_slots`: how many finished sequences keep their window state past the last full page in a host
      slot for their next turn (docs/cache.md; V4: MXFP8, not with speculative decoding; V4.1: exact, DSpark's
      rings too). `kv_store_snapshots`:
      False stores only the compressed pools (not the page-boundary window snapshots, two thirds of a block on
      small models); a prefix from the store then rebuilds its last page's snapshot by `swa_replay`: `exact`
      (window x depth tokens, the default) or `bounded` (DeepInfer's 128 tokens, attending within them).
    - Structured output: `structured_outputs_backend` (the grammar plugin for requests that name none),
      `grammar_compile_timeout` (seconds), `grammar_compile_workers` (threads).
    - `speculative_config`: `SpeculativeConfig` or its dict / JSON. `enforce_eager`: no CUDA graphs.
      `cuda_graph_sizes`: the decode batch sizes captured as CUDA graphs, all at start-up (vLLM's name; default
      1, 2, 4, 8, 12, 16, 24, 32, 48, ... up to `max_num_seqs`); a step of more sequences runs without a graph.
      `warm_up`: run every other kind of step once at start-up (prompt chunks of each size class up to
      `max_num_batched_tokens`, chunks after a prefix, mixed and verify steps) on scratch state, so no request
      compiles a kernel; None (the default) on every device but the CPU, False never (`deepserve serve
      --skip-warm-up`), True always (on the CPU too: the tests).
      `load_plugins`: load third-party plugins from the `deepserve` entry points.
    - `batch_invariant`: True asks every backend for ops whose results do not depend on the batch (the CPU
      reference's exact ops; on NVIDIA its kernels with fixed tiles and reduction orders, the reference's exact ops
      for the rest, no CUDA graphs); False for the fastest ones (the CPU
      reference on torch's kernels: 2.6-4x faster, not batch-invariant); None, each backend's default (CPU
      exact, NVIDIA fast). `DEEPSERVE_BATCH_INVARIANT` sets it when not given.
    - Scale-out (docs/distributed.md; vLLM's names): `data_parallel_size` ranks, one engine process each
      (attention data-parallel: each its own scheduler, pages and requests) behind a front; with
      `enable_expert_parallel` the routed experts are sharded over the ranks (`num_redundant_experts` extra
      slots hold copies; `expert_placement` a `phy2log` table [sites, physical] instead of the static one;
      `expert_transport` the registered transport, `all_to_all` built in). Several machines:
      `data_parallel_size_local` ranks on this one from `data_parallel_start_rank`, all meeting at
      `data_parallel_address:data_parallel_rpc_port` (the rendezvous one port above). `data_parallel_router`:
      the front's policy plugin. `data_parallel_timeout`: seconds a collective, or a rank's start, may take.
      `enable_eplb`: reassign experts while serving by DeepSeek's EPLB over the counts of the last
      `eplb_window_size` steps, every `eplb_step_interval` steps (DeepInfer's prefill defaults, 100 / 1,000;
      `num_redundant_experts` a multiple of the ranks).
      `tensor_parallel_size` > 1 is refused: V4's attention has one KV head.
    - `engine_process` (vLLM's multiprocessing engine core; docs/distributed.md): the one engine runs in a process
      of its own behind the front that data parallelism uses (`deepserve.distributed.engine_process`), so the
      caller's Python (the server's streams, JSON, socket writes) does not share the engine's GIL. Behind a
      data-parallel front every engine already runs in its own process. `DEEPSERVE_ENGINE_PROCESS` sets it when
      not given.
    - `generation_config` (vLLM's): `auto` takes the model's `generation_config.json` sampling fields as the
      defaults of requests that leave them out; `vllm` ignores the file; a folder path reads that folder's file
      (`deepserve.core.generation_config`).
    - `engram_device` (DeepSeek-V4.1 checkpoints only; docs/v41.md): `cpu` keeps the Engram tables in host memory
      whatever device the model runs on (each step gathers its rows there and copies them over); None (the
      default) puts them with the model.
    """

    model: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"
    accelerator: str = "auto"
    device: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_time_target: float = 0.5
    async_scheduling: bool = True
    block_size: int = 256
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    host_cache_bytes: int | None = None
    kv_store: str | None = None
    kv_store_deadline: float = 1.0
    kv_store_ttl_class: str = "chat"
    kv_events_config: Any = None
    swa_host_slots: int | None = None
    kv_store_snapshots: bool = True
    swa_replay: str = "exact"
    structured_outputs_backend: str = "llguidance"
    grammar_compile_timeout: float = 10.0
    grammar_compile_workers: int = 2
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    warm_up: bool | None = None
    load_plugins: bool = True
    batch_invariant: bool | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int | None = None
    data_parallel_router: str = "least_loaded"
    data_parallel_timeout: float = 120.0
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0
    expert_placement: Any = None
    expert_transport: str = "all_to_all"
    enable_eplb: bool = False
    eplb_window_size: int = 100
    eplb_step_interval: int = 1000
    engram_device: str | None = None
    engine_process: bool = False
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_scale_out()
        if self.model is not None:
            self.model = str(self.model)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization == "fp8" and self.enable_expert_parallel:
            raise ValueError("quantization='fp8' is not supported with enable_expert_parallel: the expert-parallel "
                             "ranks hold their experts dequantized (quantization 'auto' or 'none')")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.accelerator, str) or not self.accelerator:
            raise ValueError(f"accelerator must be a non-empty string, got {self.accelerator!r}")
        self.accelerator = self.accelerator.lower()
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "grammar_compile_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if isinstance(sizes, (int, str)) or not sizes or any(
                    isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive integers, got {sizes!r}")
            self.cuda_graph_sizes = tuple(sorted(set(sizes)))
        if self.warm_up is not None and not isinstance(self.warm_up, bool):
            raise ValueError(f"warm_up must be True, False or None, got {self.warm_up!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.host_cache_bytes is not None and (isinstance(self.host_cache_bytes, bool)
                                                  or not isinstance(self.host_cache_bytes, int)
                                                  or self.host_cache_bytes <= 0):
            raise ValueError(f"host_cache_bytes must be a positive integer, got {self.host_cache_bytes!r}")
        if self.kv_store is not None and (not isinstance(self.kv_store, str) or ":" not in self.kv_store):
            raise ValueError(f"kv_store must be a block store URI such as 'dir:///path', got {self.kv_store!r}")
        if not self.kv_store_deadline > 0:
            raise ValueError(f"kv_store_deadline must be a positive number of seconds, got {self.kv_store_deadline}")
        from deepserve.core.kv.events import KVEventsConfig

        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if self.kv_store_ttl_class not in ("agent", "chat"):
            raise ValueError(f"kv_store_ttl_class must be 'agent' or 'chat', got {self.kv_store_ttl_class!r}")
        if (self.kv_store or self.host_cache_bytes) and not self.enable_prefix_caching:
            raise ValueError("kv_store and host_cache_bytes hold prefix-cache blocks: they need "
                             "enable_prefix_caching")
        if self.swa_host_slots is not None:
            if isinstance(self.swa_host_slots, bool) or not isinstance(self.swa_host_slots, int) \
                    or self.swa_host_slots <= 0:
                raise ValueError(f"swa_host_slots must be a positive integer, got {self.swa_host_slots!r}")
            if not self.enable_prefix_caching:
                raise ValueError("swa_host_slots restore a sequence on top of its cached pages: they need "
                                 "enable_prefix_caching")
        if self.swa_replay not in ("exact", "bounded"):
            raise ValueError(f"swa_replay must be 'exact' or 'bounded', got {self.swa_replay!r}")
        if not self.kv_store_snapshots and self.kv_store is None:
            raise ValueError("kv_store_snapshots=False says what the block store keeps: it needs a kv_store")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.step_time_target > 0:
            raise ValueError(f"step_time_target must be a positive number of seconds, got {self.step_time_target}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout}")
        if self.engram_device not in ENGRAM_DEVICES:
            raise ValueError(f"engram_device must be 'cpu' (the V4.1 Engram tables in host memory) or None (with the "
                             f"model), got {self.engram_device!r}")

    def _check_scale_out(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} is not supported: DeepSeek-V4's attention has one "
                "KV head, so it is not split across GPUs; use data_parallel_size N with enable_expert_parallel "
                "(DP attention + EP MoE, as DeepInfer does)")
        for name, least in (("data_parallel_size", 1), ("data_parallel_size_local", 0)):  # local 0: a front only
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        start, local = self.data_parallel_start_rank, self.local_data_parallel_size
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"data_parallel_start_rank must be a non-negative integer, got {start!r}")
        if start + local > self.data_parallel_size:
            raise ValueError(f"data_parallel_start_rank {start} + data_parallel_size_local {local} exceeds "
                             f"data_parallel_size {self.data_parallel_size}")
        port = self.data_parallel_rpc_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65535):
            raise ValueError(f"data_parallel_rpc_port must be a TCP port below 65535, got {port!r}")
        if (start or local != self.data_parallel_size) and port is None:
            raise ValueError("ranks on several machines need data_parallel_rpc_port (and data_parallel_address): "
                             "every node must meet at the same address and port")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process must be True or False, got {self.engine_process!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                             f"got {self.generation_config!r}")
        if not self.data_parallel_timeout > 0:
            raise ValueError(f"data_parallel_timeout must be positive seconds, got {self.data_parallel_timeout}")
        if isinstance(self.num_redundant_experts, bool) or not isinstance(self.num_redundant_experts, int) \
                or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be a non-negative integer, got {self.num_redundant_experts!r}")
        if not self.enable_expert_parallel and (self.num_redundant_experts or self.expert_placement is not None
                                                or self.enable_eplb):
            raise ValueError("num_redundant_experts, expert_placement and enable_eplb need enable_expert_parallel=True")
        for name in ("eplb_window_size", "eplb_step_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer (steps), got {value!r}")
        if self.enable_eplb and self.num_redundant_experts % self.data_parallel_size:
            raise ValueError(f"with enable_eplb, num_redundant_experts ({self.num_redundant_experts}) must be a "
                             f"multiple of data_parallel_size ({self.data_parallel_size}): EPLB gives every rank "
                             "the same number of extra slots")

    @property
    def local_data_parallel_size(self) -> int:
        """Ranks started on this machine."""
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def in_engine_process(self) -> bool:
        """True when one engine runs in its own process behind the front (`engine_process` without scale-out)."""
        return self.engine_process and not self.distributed

    @property
    def distributed(self) -> bool:
        """True when the engine runs as ranks behind a front (data parallelism, expert parallelism or both)."""
        return self.data_parallel_size > 1 or self.enable_expert_parallel

    @classmethod
    def from_options(cls, model: Any = None, **options: Any) -> EngineConfig:
        """`EngineConfig(model=model, **options)`, with an unknown option named in a TypeError that lists the
        known ones (a misspelt keyword should not pass silently)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; the options are {sorted(known - {'model'})}")
        return cls(model=model, **options)


def model_config_to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg` as a Hugging Face `config.json` dict (`DeepseekV4Config` fields) that transformers also loads."""

    def rope(r: RopeConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": "default", "rope_theta": r.theta,
                               "partial_rotary_factor": r.rotary_dim / cfg.head_dim}
        if r.yarn_factor:
            out.update(rope_type="yarn", factor=r.yarn_factor, attention_factor=1.0,
                       original_max_position_embeddings=r.yarn_original_max_position,
                       beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        return out

    return {
        "architectures": list(SUPPORTED_ARCHITECTURES),
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "mlp_layer_types": list(cfg.mlp_layer_types),
        "compress_rates": dict(cfg.compress_rates),
        "rope_theta": cfg.main_rope.theta,
        "compress_rope_theta": cfg.compress_rope.theta,
        "rope_parameters": {"main": rope(cfg.main_rope), "compress": rope(cfg.compress_rope)},
        "max_position_embeddings": cfg.max_position_embeddings,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.torch_dtype or "float32",
    }
