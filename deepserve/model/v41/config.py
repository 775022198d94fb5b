"""The shape of a DeepSeek-V4.1 checkpoint, read from either spelling of its config (v41-architecture.md §1.1):
the HF `config.json` (`text_config` keys, `model_type` `deepseek_v41`) or the reference's `inference/config.json`
(ModelArgs keys). Every size and layer role of the model comes from here; nothing is assumed from Flash."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


class V41ConfigError(ValueError):
    """A V4.1 config that is missing a key or names an inconsistent layout."""


# HF text_config key -> reference (inference/config.json) key, for the keys whose names differ.
_HF_TO_REF = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads", "qk_rope_head_dim": "rope_head_dim", "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer", "rms_norm_eps": "norm_eps",
    "num_experts_per_tok": "n_activated_experts", "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale", "engram_pad_token_id": "engram_pad_id",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    dim: int
    n_layers: int
    n_mtp_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    original_seq_len: int
    rope_factor: float
    beta_fast: float
    beta_slow: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    score_func: str
    norm_topk_prob: bool
    route_scale: float
    swiglu_limit: float
    gate_temp: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_compressed_vocab_size: int
    engram_pad_id: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    image_token_id: int = -1
    bos_token_id: int = 0
    eos_token_id: int = 1
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        n = self.n_layers
        if len(self.compress_ratios) != n + self.n_mtp_layers:
            raise V41ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries; expected "
                                 f"{n} backbone + {self.n_mtp_layers} DSpark layers")
        if any(r not in (0, 1, 2, 4) for r in self.compress_ratios):
            raise V41ConfigError(f"compress_ratios {list(self.compress_ratios)}: V4.1 ratios are 0, 1 or 2")
        if any(self.compress_ratios[n + i] for i in range(self.n_mtp_layers)):
            raise V41ConfigError("DSpark layers are window-only: their compress_ratios must be 0")
        for j in self.kv_source_layers:
            if not 0 <= j < n or self.compress_ratios[j] == 0:
                raise V41ConfigError(f"kv source layer {j} must be a backbone layer with a nonzero ratio")
        for j in self.index_source_layers:
            if not 0 <= j < n or self.compress_ratios[j] == 0:
                raise V41ConfigError(f"index source layer {j} must be a backbone layer with a nonzero ratio")
        for j in range(n):
            r = self.compress_ratios[j]
            if not r:
                continue
            kv, ix = self.kv_source_of(j), self.index_source_of(j)
            if kv is None or self.compress_ratios[kv] != r:
                raise V41ConfigError(f"layer {j} (ratio {r}): the nearest kv source at or before it ({kv}) "
                                     "must exist and have the same ratio")
            if ix is None or self.compress_ratios[ix] != r or ix < kv:
                raise V41ConfigError(f"layer {j} (ratio {r}): the nearest index source at or before it ({ix}) "
                                     f"must have its ratio and read the same kv source ({kv})")
        cand = self.candidate_source_layer
        if cand >= 0 and cand not in self.index_source_layers:
            raise V41ConfigError(f"candidate source {cand} is not an index source")
        for j in self.index_source_layers:  # later index sources score inside the candidate source's blocks
            if 0 <= cand < j and self.compress_ratios[j] != self.compress_ratios[cand]:
                raise V41ConfigError(f"index source {j} (ratio {self.compress_ratios[j]}) follows the candidate "
                                     f"source {cand} (ratio {self.compress_ratios[cand]}): their ratios must match")
        for j in self.engram_layer_ids:
            if not 0 <= j < n:
                raise V41ConfigError(f"engram layer {j} is not a backbone layer")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise V41ConfigError("engram_num_embeddings needs one row count per engram layer")
        for j in self.dspark_target_layer_ids:
            if not 0 <= j < n:
                raise V41ConfigError(f"DSpark target layer {j} is not a backbone layer")
        if self.n_mtp_layers and not self.dspark_block_size:
            raise V41ConfigError("DSpark layers need dspark_block_size > 0")
        if self.n_shared_experts != 1:
            raise V41ConfigError(f"n_shared_experts {self.n_shared_experts}: V4.1 has exactly one shared expert")
        if self.score_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise V41ConfigError(f"unknown scoring_func {self.score_func!r}")
        for name in ("dim", "head_dim", "q_lora_rank", "index_head_dim", "moe_inter_dim"):
            if getattr(self, name) % 32:
                raise V41ConfigError(f"{name}={getattr(self, name)} must be a multiple of 32 (FP8/FP4 blocks)")

    # -- what the engine reads (the names of V4's `ModelConfig`) ------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

    @property
    def max_position_embeddings(self) -> int:
        """The HF config's `max_position_embeddings` (the reference's `max_seq_len`), else the YaRN-extended
        length `original_seq_len * rope_factor`."""
        n = self.raw.get("max_position_embeddings") or self.raw.get("max_seq_len")
        if n:
            return int(n)
        if self.original_seq_len:
            return int(self.original_seq_len * self.rope_factor)
        raise V41ConfigError("the config gives no max_position_embeddings (or max_seq_len, or a YaRN "
                             "original_max_position_embeddings)")

    # -- layer roles (v41-architecture.md §1.2) ---------------------------------------------------------------
    def kv_source_of(self, layer: int) -> int | None:
        """The kv source whose compressed cache (and index keys) `layer` reads: the nearest at or before it."""
        found = [s for s in self.kv_source_layers if s <= layer]
        return max(found) if found else None

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose top-k `layer` uses: the nearest at or before it."""
        found = [s for s in self.index_source_layers if s <= layer]
        return max(found) if found else None

    def role(self, layer: int) -> str:
        if layer >= self.n_layers:
            return "dspark"
        if self.compress_ratios[layer] == 0:
            return "window"
        if layer in self.kv_source_layers:
            return "full"
        if layer in self.index_source_layers:
            return "reindex"
        return "reuse"

    def moe_shape(self, layer: int) -> tuple[int, int]:
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    # -- readers -----------------------------------------------------------------------------------------------
    @classmethod
    def from_reference(cls, d: dict) -> "V41Config":
        """From the reference's ModelArgs keys (`inference/config.json`)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"raw"}
        missing = sorted(n for n in names if n not in d and n not in _DEFAULTS)
        if missing:
            raise V41ConfigError(f"config lacks {missing}")
        kw = {n: d.get(n, _DEFAULTS.get(n)) for n in names}
        for n, f in ((f.name, f) for f in dataclasses.fields(cls)):
            if n in kw and isinstance(kw[n], list):
                kw[n] = tuple(kw[n])
        if d.get("dtype", "fp8") != "fp8" or d.get("expert_dtype", "fp4") != "fp4":
            raise V41ConfigError("deepserve reads V4.1 checkpoints with FP8 dense weights and FP4 experts")
        return cls(**kw, raw=dict(d))

    @classmethod
    def from_hf(cls, d: dict) -> "V41Config":
        """From an HF config: `model_type` `deepseek_v41`, sizes under `text_config` (or at the top level)."""
        if d.get("model_type") not in ("deepseek_v41", None):
            raise V41ConfigError(f"model_type {d.get('model_type')!r} is not deepseek_v41")
        text = dict(d.get("text_config") or d)
        q = d.get("quantization_config") or {}
        if q and (q.get("weight_block_size") not in ([32, 32], None) or q.get("scale_fmt", "ue8m0") != "ue8m0"):
            raise V41ConfigError(f"quantization_config {q}: V4.1 stores FP8 with 32x32 UE8M0 blocks")
        ref = {_HF_TO_REF.get(k, k): v for k, v in text.items()}
        rs = text.get("rope_scaling") or {}
        ref["original_seq_len"] = int(rs.get("original_max_position_embeddings", 0))
        ref["rope_factor"] = float(rs.get("factor", 1.0))
        ref["beta_fast"] = rs.get("beta_fast", 32)
        ref["beta_slow"] = rs.get("beta_slow", 1)
        if text.get("num_key_value_heads", 1) != 1:
            raise V41ConfigError("V4.1 attention has one K=V head (num_key_value_heads 1)")
        if text.get("hc_shifted", True) is not True:
            raise V41ConfigError("V4.1 mHC is single-pass (hc_shifted true)")
        for k in ("bos_token_id", "eos_token_id"):
            if k in d and k not in ref:
                ref[k] = d[k]
        return cls.from_reference(ref)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "V41Config":
        """config.json (HF spelling), else inference/config.json (reference spelling)."""
        model_dir = Path(model_dir)
        hf, ref = model_dir / "config.json", model_dir / "inference" / "config.json"
        if not hf.is_file() and not ref.is_file():
            raise V41ConfigError(f"{model_dir} has neither config.json nor inference/config.json")
        try:
            if hf.is_file():
                return cls.from_hf(json.loads(hf.read_text()))
        except V41ConfigError as exc:
            if not ref.is_file():
                raise V41ConfigError(f"{hf}: {exc}") from exc
            logger.warning("%s: %s; reading %s instead", hf, exc, ref)
        try:
            return cls.from_reference(json.loads(ref.read_text()))
        except V41ConfigError as exc:
            raise V41ConfigError(f"{ref}: {exc}") from exc


_DEFAULTS = {
    "image_token_id": -1, "bos_token_id": 0, "eos_token_id": 1, "gate_temp": 1.0, "norm_topk_prob": True,
    "candidate_source_layer": -1, "candidate_topk_blocks": 0, "candidate_block_size": 0,
    "engram_layer_ids": (), "engram_num_embeddings": (), "engram_max_ngram_size": 1, "engram_n_heads": 0,
    "engram_head_dim": 0, "engram_vocab_size": 0, "engram_compressed_vocab_size": 0, "engram_pad_id": 2,
    "dspark_block_size": 0, "dspark_noise_token_id": 0, "dspark_target_layer_ids": (), "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 0, "dspark_n_activated_experts": 0, "n_shared_experts": 1, "swiglu_limit": 0.0,
    "original_seq_len": 0, "rope_factor": 1.0, "beta_fast": 32, "beta_slow": 1, "n_mtp_layers": 0,
}
