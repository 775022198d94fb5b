"""Build a ready-to-run V4 model from a checkpoint directory, or with random weights for demos and tests."""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import torch

from deepserve.core.config import ModelConfig
from deepserve.core.interfaces import Backend

from .deepseek_v4 import DeepseekV4ForCausalLM
from .registry import model_class
from .loader import load_weights, prepare_stored, put_tensor, read_checkpoint, read_config, stored_scheme
from .weight_names import keeps_fp32

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, backend: Backend) -> torch.dtype:
    """`auto`: bf16 on accelerators, fp32 on CPU (bf16 matmuls are slow there and the oracle runs in fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {dtype!r}")
        return _DTYPES[dtype]
    return torch.float32 if torch.device(backend.device).type == "cpu" else torch.bfloat16


def load_model(
    model_dir: str | os.PathLike, backend: Backend, dtype: str | torch.dtype = "auto", progress: bool = True,
    quantization: str = "auto",
) -> DeepseekV4ForCausalLM:
    """Read config and weights, build the model on the backend's device and copy the weights in.

    A checkpoint without `mtp.*` tensors (every file transformers writes) gets a model without MTP blocks.
    `quantization` (`auto`, `fp8`, `none`): which weights stay FP8/FP4 as stored (`loader.stored_scheme`).
    """
    cfg = read_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg, backend)
    scheme, quantize = stored_scheme(cfg, quantization)
    state = read_checkpoint(model_dir, dtype=torch_dtype, device=backend.device, progress=progress, scheme=scheme,
                            quantize=quantize)
    if cfg.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in state):
        logger.info("%s has no mtp.* tensors: loading without the MTP block", model_dir)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    model = build_model(cfg, backend, torch_dtype, params_on_meta=True)
    if scheme is not None and prepare_stored(model, state, scheme):
        logger.info("%s: FP8/FP4 weights kept as stored (%.1f MiB of weights)", model_dir, weight_bytes(model) / 2**20)
    load_weights(model, state)
    model.share_projection_inputs()
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers hold, as stored (FP8/FP4 weights at their stored size)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for t in tensors.values())


def build_model(cfg: ModelConfig, backend: Backend, dtype: torch.dtype,
                params_on_meta: bool = False) -> DeepseekV4ForCausalLM:
    """An uninitialised model of the class registered for the config's `model_type` (`registry.py`), on the
    backend's device; fp32-kept parameters stay fp32 as in the reference.

    `params_on_meta`: every parameter is a shape on the meta device, swapped in as each module registers it (its
    constructor's tensor is freed at once), and `loader.load_weights` puts the checkpoint's tensors in their
    place; buffers (RoPE frequencies, routing tables) are made on the device as usual. Loading then holds the
    checkpoint's tensors and nothing else: built on the device, a 23B model was an fp32 copy (92 GB) beside the
    stored one (15 GB) before the stored weights replaced it, more than an H100 holds."""
    hook = None
    if params_on_meta:
        def to_meta(module, name, param):
            if param is None or param.is_meta:
                return None
            return torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                      requires_grad=False)

        hook = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        with torch.device(backend.device):
            model = model_class(cfg.raw.get("model_type"))(cfg, backend)
    finally:
        if hook is not None:
            hook.remove()
    for name, p in model.named_parameters():
        if p.dtype == torch.float32 and not _keeps_fp32(name):
            p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def materialize(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """Give each meta parameter (`build_model(..., params_on_meta=True)`) uninitialised storage on `device`, in its
    dtype: a model to fill (`randomize`) without ever holding it in the constructors' fp32."""
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            put_tensor(model, name, p, torch.empty(p.shape, dtype=p.dtype, device=device))
    return model


def _keeps_fp32(name: str) -> bool:
    return keeps_fp32(name) or name.endswith("norm.weight")  # enorm/hnorm of the MTP block too


@torch.no_grad()
def randomize(model: DeepseekV4ForCausalLM, seed: int = 0) -> DeepseekV4ForCausalLM:
    """Fill every weight with a reproducible, non-degenerate random value (fan-in scaled linears, random sinks,
    position biases, router biases and hash tables). For demos and tests that need a model, not a trained one."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif leaf in ("sinks", "base", "hc_base", "position_bias"):
            val = 0.5 * torch.randn(p.shape, generator=g)
        elif leaf in ("scale", "hc_scale"):
            val = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
        elif leaf in ("fn", "hc_fn"):
            val = torch.randn(p.shape, generator=g) * 0.5 / math.sqrt(p.shape[-1])
        elif name.endswith("embed_tokens.weight"):
            val = torch.randn(p.shape, generator=g)
        else:
            val = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        p.copy_(val.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
        elif name.endswith("tid2eid"):
            rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]
            b.copy_(torch.stack(rows))
    return model
