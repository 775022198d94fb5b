"""Tensor names: map the three spellings of a DeepSeek-V4 checkpoint onto one canonical spelling.

Canonical = the names `transformers`' `DeepseekV4ForCausalLM.state_dict()` produces (spec section 5.1):
`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_a_proj.weight`, `model.layers.{i}.mlp.experts.gate_up_proj`,
`model.hc_head.hc_fn`, `lm_head.weight`, ... The MTP block, which HF does not build, is `mtp.{k}.` followed by the
same HF-style block names plus `enorm`, `hnorm`, `e_proj`, `h_proj`, `hc_head.hc_*` and `norm`.

Accepted sources: (a) those canonical names; (b) the official release (`embed.weight`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.ffn.experts.{e}.w1.weight`, `mtp.0.*`, FP8 `.scale` companions); (c) the hybrid `save_pretrained`
writes (official names under a `model.` prefix, `head.weight` at the root, main-attention kv_norm as `attn.norm`).

Per-expert tensors get an intermediate name `...mlp.experts.{e}.w{1,2,3}.weight` from `canonical_name`;
`ExpertStacker` then stacks them into `gate_up_proj` [E, 2I, D] (w1 rows, then w3 rows) and `down_proj` [E, D, I].
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

SCALE_SUFFIX = ".weight_scale_inv"

_ROOT = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
}
_BLOCK = {"attn": "self_attn", "ffn": "mlp", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_ATTN = {
    "wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
    "norm": "kv_norm",  # the hybrid save_pretrained spelling of the main attention's kv_norm
    "wo_a": "o_a_proj", "wo_b": "o_b_proj", "attn_sink": "sinks",
}
_COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"}
_INDEXER = {"wq_b": "q_b_proj", "weights_proj": "scorer.weights_proj"}
_GATE = {"bias": "e_score_correction_bias"}
_SHARED = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HC_LEAF = re.compile(r"^(hc_attn|hc_ffn|hc_head)_(fn|base|scale)$")
_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT_PIECE = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")

# HF `_keep_in_fp32_modules_strict` plus the MTP-only norms: these stay fp32 whatever dtype is asked for.
FP32_MODULES = frozenset({
    "input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc", "hc_head", "norm", "kv_norm",
    "q_a_norm", "sinks", "position_bias", "e_score_correction_bias", "enorm", "hnorm",
})


def _join(head: str, rest: str) -> str:
    return f"{head}.{rest}" if rest else head


def _attn(path: str) -> str:
    head, _, rest = path.partition(".")
    if head == "compressor":
        return "compressor." + _compressor(rest)
    if head == "indexer":  # official `attn.indexer.*` lives under the compressor in HF
        sub, _, tail = rest.partition(".")
        if sub == "compressor":
            return "compressor.indexer." + _compressor(tail)
        return "compressor.indexer." + _join(_INDEXER.get(sub, sub), tail)
    return _join(_ATTN.get(head, head), rest)


def _compressor(path: str) -> str:
    head, _, rest = path.partition(".")
    if head == "indexer":  # already HF: compressor.indexer.{kv_proj,gate_proj,...}
        return path
    return _join(_COMPRESSOR.get(head, head), rest)


def _ffn(path: str) -> str:
    head, _, rest = path.partition(".")
    if head == "gate":
        return "gate." + _GATE.get(rest, rest)
    if head == "shared_experts":
        sub, _, tail = rest.partition(".")
        return "shared_experts." + _join(_SHARED.get(sub, sub), tail)
    return path


def _block(path: str) -> str:
    hc = _HC_LEAF.match(path)
    if hc:
        kind, leaf = hc.groups()
        return {"hc_attn": "attn_hc.", "hc_ffn": "ffn_hc.", "hc_head": "hc_head.hc_"}[kind] + leaf
    head, _, rest = path.partition(".")
    head = _BLOCK.get(head, head)
    if head == "self_attn":
        return "self_attn." + _attn(rest)
    if head == "mlp":
        return "mlp." + _ffn(rest)
    return _join(head, rest)


def _scale_suffix(name: str) -> str:
    """FP8 `<linear>.scale` -> `<linear>.weight_scale_inv`; the mHC `attn_hc.scale`/`ffn_hc.scale` are parameters."""
    if name.endswith(".scale") and name.rsplit(".", 2)[-2] not in ("attn_hc", "ffn_hc"):
        return name[: -len(".scale")] + SCALE_SUFFIX
    return name


def canonical_name(name: str) -> str:
    """Map a tensor name in any accepted spelling to its canonical name (idempotent on canonical names).

    Per-expert tensors map to the intermediate `...mlp.experts.{e}.w{1,2,3}.weight` (see `ExpertStacker`);
    names that match no rule come back with only the generic renames applied, so a loader reports them as unexpected.
    """
    body = name[len("model."):] if name.startswith("model.") else name
    if body in _ROOT:
        return _ROOT[body]
    if body.endswith(".scale") and body[: -len("scale")] + "weight" in _ROOT:
        return _ROOT[body[: -len("scale")] + "weight"][: -len(".weight")] + SCALE_SUFFIX
    hc = _HC_LEAF.match(body)
    if hc and hc.group(1) == "hc_head":
        return "model.hc_head.hc_" + hc.group(2)
    if body.startswith("hc_head."):
        return "model." + body
    layer = _LAYER.match(body)
    if not layer:
        return name
    scope, index, rest = layer.groups()
    prefix = f"model.layers.{index}." if scope == "layers" else f"mtp.{index}."
    return _scale_suffix(prefix + _block(rest))


def keeps_fp32(name: str) -> bool:
    """True for canonical names HF keeps in fp32 regardless of the model dtype (norms, mHC, sinks, biases)."""
    return any(part in FP32_MODULES for part in name.split("."))


def expert_piece(name: str) -> tuple[str, int, str] | None:
    """`(stacked prefix, expert index, "w1"|"w2"|"w3")` for an intermediate per-expert name, else None."""
    match = _EXPERT_PIECE.match(name)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


class ExpertStacker:
    """Collects per-expert w1/w2/w3 tensors and emits `gate_up_proj`/`down_proj` once a layer is complete.

    `num_experts` (from the config) lets a layer be stacked as soon as its last piece arrives and lets
    `finish()` name a missing expert; without it, the count is inferred from the highest index seen.
    """

    def __init__(self, num_experts: int | None = None) -> None:
        self.num_experts = num_experts
        self._pieces: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)

    def add(self, prefix: str, expert: int, part: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Store one piece; return the stacked tensors of `prefix` if this piece completed it, else `{}`."""
        pieces = self._pieces[prefix]
        pieces[(expert, part)] = tensor
        if self.num_experts is not None and len(pieces) == 3 * self.num_experts:
            return self._stack(prefix, self.num_experts)
        return {}

    def finish(self) -> dict[str, torch.Tensor]:
        """Stack every layer still pending; raise `KeyError` naming the first missing expert tensor."""
        out: dict[str, torch.Tensor] = {}
        for prefix in list(self._pieces):
            count = self.num_experts or 1 + max(e for e, _ in self._pieces[prefix])
            out.update(self._stack(prefix, count))
        return out

    def _stack(self, prefix: str, count: int) -> dict[str, torch.Tensor]:
        pieces = self._pieces.pop(prefix)
        for expert in range(count):
            for part in ("w1", "w2", "w3"):
                if (expert, part) not in pieces:
                    raise KeyError(f"missing expert tensor {prefix}.{expert}.{part}.weight")
        extra = sorted({e for e, _ in pieces if e >= count})
        if extra:
            raise KeyError(f"{prefix} has experts {extra} beyond the configured {count}")
        gate_up = torch.stack([torch.cat([pieces[(e, "w1")], pieces[(e, "w3")]], dim=0) for e in range(count)])
        down = torch.stack([pieces[(e, "w2")] for e in range(count)])
        return {prefix + ".gate_up_proj": gate_up, prefix + ".down_proj": down}
