"""Load a V4.1 checkpoint in the released layout (v41-architecture.md §8, golden format `tiny/`).

Reference names without a `model.` prefix (one is accepted and dropped); dense weights FP8 e4m3 with 32x32 UE8M0
`.scale`s, kept in stored precision; routed experts int8-packed e2m1 (or float4_e2m1fn_x2) with a UE8M0 scale
per 32 inputs; `wo_a` and ratio-2 compressor weights FP8 in the file, dequantized on load (bf16 and fp32, as the
reference runs them); the bf16 head and confidence head computed in fp32; `ffn.gate.bias_vl` read (image tokens
are refused until the vision role exists). Every tensor is placed or named in the error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import V41Config
from .model import Block, DeepseekV41ForCausalLM
from .moe import Expert
from .numerics import QuantWeight, dequant_fp8_tiles


_VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


class V41CheckpointError(ValueError):
    """A V4.1 checkpoint whose tensors do not match its config."""


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()}) \
        if index.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise V41CheckpointError(f"{model_dir} holds no safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for k in h.keys():
                name = k[len("model."):] if k.startswith("model.") else k
                if name in out:
                    raise V41CheckpointError(f"tensor {name!r} appears twice ({f.name})")
                out[name] = h.get_tensor(k)
    return out


class _Reader:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t, self.used = tensors, set()

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.t:
            raise V41CheckpointError(f"checkpoint lacks {name!r}")
        self.used.add(name)
        return self.t[name]

    def has(self, name: str) -> bool:
        return name in self.t

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.raw(name)
        if tuple(t.shape) != tuple(shape):
            raise V41CheckpointError(f"{name}: shape {tuple(t.shape)}, config says {tuple(shape)}")
        # a fresh (64-byte aligned) copy: tensors read from a file can sit at any offset, and the BLAS
        # kernels round differently for unaligned operands, which V4.1's quantization amplifies
        return t.to(dtype, copy=True).contiguous()

    def fp8(self, prefix: str, out_f: int, in_f: int) -> QuantWeight:
        w = self.raw(prefix + ".weight")
        if w.dtype != torch.float8_e4m3fn:
            raise V41CheckpointError(f"{prefix}.weight is {w.dtype}; the released layout stores it FP8 e4m3")
        if tuple(w.shape) != (out_f, in_f):
            raise V41CheckpointError(f"{prefix}.weight: shape {tuple(w.shape)}, config says {(out_f, in_f)}")
        try:
            return QuantWeight.fp8(w, self.raw(prefix + ".scale"))
        except ValueError as exc:
            raise V41CheckpointError(f"{prefix}: {exc}") from exc

    def dequant(self, prefix: str, out_f: int, in_f: int, dtype: torch.dtype) -> torch.Tensor:
        """FP8 in the file (dequantized) or already in a float dtype."""
        w = self.raw(prefix + ".weight")
        if tuple(w.shape) != (out_f, in_f):
            raise V41CheckpointError(f"{prefix}.weight: shape {tuple(w.shape)}, config says {(out_f, in_f)}")
        if w.dtype == torch.float8_e4m3fn:
            return dequant_fp8_tiles(w, self.raw(prefix + ".scale")).to(dtype)
        return w.to(dtype, copy=True).contiguous()

    def fp4(self, prefix: str, out_f: int, in_f: int) -> QuantWeight:
        w = self.raw(prefix + ".weight")
        if w.dtype == torch.float4_e2m1fn_x2:
            w = w.view(torch.uint8)
        if w.dtype not in (torch.int8, torch.uint8):
            raise V41CheckpointError(f"{prefix}.weight is {w.dtype}; routed experts are int8-packed e2m1")
        if tuple(w.shape) != (out_f, in_f // 2):
            raise V41CheckpointError(f"{prefix}.weight: shape {tuple(w.shape)}, config says {(out_f, in_f // 2)}")
        try:
            return QuantWeight.fp4(w, self.raw(prefix + ".scale"))
        except ValueError as exc:
            raise V41CheckpointError(f"{prefix}: {exc}") from exc


def _load_block(r: _Reader, cfg: V41Config, blk: Block, p: str) -> None:
    c, a = cfg, blk.attn
    d, hd, f32, bf16 = c.dim, c.head_dim, torch.float32, torch.bfloat16
    mix = (2 + c.hc_mult) * c.hc_mult
    blk.attn_norm = r.tensor(p + "attn_norm.weight", bf16, (d,))
    blk.ffn_norm = r.tensor(p + "ffn_norm.weight", bf16, (d,))
    for site in ("attn", "ffn"):
        setattr(blk, "hc_" + site, (r.tensor(f"{p}hc_{site}_fn", f32, (mix, c.hc_mult * d)),
                                    r.tensor(f"{p}hc_{site}_scale", f32, (3,)),
                                    r.tensor(f"{p}hc_{site}_base", f32, (mix,))))
    q = p + "attn."
    a.wq_a = r.fp8(q + "wq_a", c.q_lora_rank, d)
    a.q_norm = r.tensor(q + "q_norm.weight", bf16, (c.q_lora_rank,))
    a.wq_b = r.fp8(q + "wq_b", c.n_heads * hd, c.q_lora_rank)
    a.wkv = r.fp8(q + "wkv", hd, d)
    a.kv_norm = r.tensor(q + "kv_norm.weight", bf16, (hd,))
    a.wo_a = r.dequant(q + "wo_a", c.o_groups * c.o_lora_rank, c.n_heads * hd // c.o_groups, bf16)
    a.wo_b = r.fp8(q + "wo_b", d, c.o_groups * c.o_lora_rank)
    a.sink = r.tensor(q + "attn_sink", f32, (c.n_heads,))
    if a.kv_source:
        dt = f32 if a.ratio > 1 else bf16
        a.c_wkv = r.dequant(q + "compressor.wkv", hd, d, dt)
        if a.ratio > 1:
            a.c_wgate = r.dequant(q + "compressor.wgate", hd, d, f32)
        a.c_norm = r.tensor(q + "compressor.norm.weight", bf16, (hd,))
    if a.index_source:
        a.i_wq_b = r.fp8(q + "indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        a.i_weights = r.tensor(q + "indexer.weights_proj.weight", bf16, (c.index_n_heads, d))
        if a.owns_index_keys:
            a.i_wk = r.tensor(q + "indexer.wk.weight", bf16, (c.index_head_dim, hd))
            a.i_k_norm = r.tensor(q + "indexer.k_norm.weight", bf16, (c.index_head_dim,))
    m, g = blk.ffn, p + "ffn."
    m.gate_weight = r.tensor(g + "gate.weight", bf16, (m.n_experts, d))
    m.gate_bias = r.tensor(g + "gate.bias", f32, (m.n_experts,))
    if r.has(g + "gate.bias_vl"):
        m.gate_bias_vl = r.tensor(g + "gate.bias_vl", f32, (m.n_experts,))
    inter = c.moe_inter_dim
    m.experts = [Expert(r.fp4(f"{g}experts.{e}.w1", inter, d), r.fp4(f"{g}experts.{e}.w2", d, inter),
                        r.fp4(f"{g}experts.{e}.w3", inter, d), c.swiglu_limit) for e in range(m.n_experts)]
    m.shared = Expert(r.fp8(g + "shared_experts.w1", inter, d), r.fp8(g + "shared_experts.w2", d, inter),
                      r.fp8(g + "shared_experts.w3", inter, d), c.swiglu_limit)
    if blk.engram is not None:
        e, n_cols = blk.engram, (c.engram_max_ngram_size - 1) * c.engram_n_heads
        rows = c.engram_num_embeddings[e.index]
        w = r.tensor(p + "engram.embed.weight", torch.float8_e4m3fn, (rows, c.engram_head_dim))
        e.table.weight = w
        e.table.scale = r.tensor(p + "engram.embed.scale", f32, (rows, c.engram_head_dim // 32))
        e.wkv = r.fp8(p + "engram.wkv", d * (c.hc_mult + 1), n_cols * c.engram_head_dim)
        e.q_weight.data = r.tensor(p + "engram.q_weight", bf16, (c.hc_mult, d))
        e.k_weight.data = r.tensor(p + "engram.k_weight", bf16, (c.hc_mult, d))


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise V41CheckpointError(f"{path} is missing: Engram's hash needs the checkpoint's tokenizer")
    return Tokenizer.from_file(str(path))


def load_v41(model_dir: str | Path, engram_device: str | None = None) -> DeepseekV41ForCausalLM:
    """Config, tokenizer and every tensor of a V4.1 checkpoint directory -> a ready model (CPU).
    engram_device: keep the Engram tables there (e.g. "cpu", host memory) whatever device the model moves to."""
    cfg = V41Config.from_dir(model_dir)
    tok = load_tokenizer(model_dir) if cfg.engram_layer_ids else None
    model = DeepseekV41ForCausalLM(cfg, tokenizer=tok)
    load_state(model, read_tensors(model_dir))
    if engram_device is not None:
        for blk in model.layers:
            if blk.engram is not None:
                blk.engram.table.place(engram_device)
    return model


def load_state(model: DeepseekV41ForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    r = _Reader(tensors)
    fill_weights(model, r)
    # the vision tower and aligner are not built (text only: image inputs are refused), so their tensors are
    # expected and skipped; anything else unplaced is an error
    left = sorted(n for n in set(tensors) - r.used if not n.startswith(_VISION_PREFIXES))
    if left:
        raise V41CheckpointError(f"{len(left)} checkpoint tensors match nothing in the config, e.g. {left[:5]}")


def fill_weights(model: DeepseekV41ForCausalLM, r) -> None:
    """Set every weight of `model` from the reader `r` (`_Reader` over a checkpoint's tensors; a benchmark's
    synthetic reader gives each name a random tensor of the shape and kind asked for)."""
    c = model.cfg
    bf16, f32 = torch.bfloat16, torch.float32
    model.embed = r.tensor("embed.weight", bf16, (c.vocab_size, c.dim))
    model.norm = r.tensor("norm.weight", bf16, (c.dim,))
    model.head = r.tensor("head.weight", f32, (c.vocab_size, c.dim))  # bf16 in the file, used in fp32
    for j, blk in enumerate(model.layers):
        _load_block(r, c, blk, f"layers.{j}.")
    if c.n_mtp_layers:
        for i, blk in enumerate(model.mtp):
            _load_block(r, c, blk, f"mtp.{i}.")
            for tied in ("embed.weight", "head.weight"):  # DSpark shares the backbone's; a copy may be stored
                if r.has(f"mtp.{i}.{tied}"):
                    r.raw(f"mtp.{i}.{tied}")
        taps = len(c.dspark_target_layer_ids)
        model.main_proj = r.fp8("mtp.0.main_proj", c.dim, taps * c.dim)
        model.main_norm = r.tensor("mtp.0.main_norm.weight", bf16, (c.dim,))
        last = f"mtp.{c.n_mtp_layers - 1}."
        model.mtp_norm = r.tensor(last + "norm.weight", bf16, (c.dim,))
        model.markov_embed = r.tensor(last + "markov_head.embed.weight", bf16, (c.vocab_size, c.dspark_markov_rank))
        model.markov_head = r.tensor(last + "markov_head.head.weight", f32, (c.vocab_size, c.dspark_markov_rank))
        model.confidence = r.tensor(last + "confidence_head.proj.weight", f32, (1, c.dim + c.dspark_markov_rank))
