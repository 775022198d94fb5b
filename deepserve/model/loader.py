"""Read a DeepSeek-V4 checkpoint directory into canonical, dequantized tensors and copy them into a module.

`read_checkpoint` accepts a single `model.safetensors`, a sharded checkpoint with `model.safetensors.index.json`,
or any set of `*.safetensors` files, in any of the three tensor spellings (see `weight_names`). FP8/FP4 weights
are dequantized (see `quant`), or kept as stored with their scales under `<weight>_scale_inv` (`scheme`, the
`--quantization` option: `stored_scheme`), per-expert tensors are stacked, and the result is keyed by the
canonical names, which are the `state_dict()` names of HF's `DeepseekV4ForCausalLM` (and of deepserve's own model).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from deepserve.core.config import QUANTIZATIONS, ConfigError, ModelConfig
from deepserve.model.common import keep_stored
from deepserve.model.quant import (
    FP4_BLOCK as FP4_GROUP,
    QuantizationConfigError,
    QuantScheme,
    check_scale,
    dequantize,
    quantize_stored,
    scale_name as stored_scale_name,
)
from deepserve.model.weight_names import SCALE_SUFFIX, ExpertStacker, canonical_name, expert_piece, keeps_fp32

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


class CheckpointError(ValueError):
    """A checkpoint deepserve cannot load; the message names the file or tensor at fault."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """The checkpoint's `config.json` was rejected by `ModelConfig`; caught by either base class."""


def _model_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist or is not a directory")
    return path


def find_weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: `model.safetensors`, else the shards named by the index, else
    every `*.safetensors` file (sorted). Raises `CheckpointError` naming the path when none, or a shard, is missing."""
    path = _model_dir(model_dir)
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        shards = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(shard) for shard in shards if not shard.is_file()]
        if missing:
            raise CheckpointError(f"shard(s) named in {index} are missing: {', '.join(missing)}")
        return shards
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {path} (expected {SINGLE_FILE}, {INDEX_FILE} or *.safetensors)")
    return files


def read_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Parse `config.json` of a checkpoint, re-raising config problems with the path attached."""
    path = _model_dir(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"model config {path} does not exist")
    try:
        return ModelConfig.from_file(path)
    except ConfigError as exc:
        raise CheckpointConfigError(f"{path}: {exc}") from exc


def stored_scheme(config: ModelConfig, quantization: str = "auto") -> tuple[QuantScheme | None, bool]:
    """What `--quantization` (vLLM's flag) means for this checkpoint: (the scheme weights are kept in, or None to
    dequantize to the model dtype; whether plain weights the scheme stores quantized are quantized at load).
    `auto`: the checkpoint's `quantization_config` (none: dequantize, as before); `fp8`: DeepSeek's scheme (the
    config's blocks when it has one, else FP8 128x128 dense and FP4 routed experts), a bf16 checkpoint quantized
    at load; `none`: dequantize everything."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return None, False
    try:
        scheme = QuantScheme.from_hf(config.quantization_config, config.raw)
    except QuantizationConfigError as exc:
        raise CheckpointConfigError(f"quantization_config: {exc}") from exc
    if quantization == "fp8":
        return scheme or QuantScheme(), True
    return scheme, False


def _open_all(files: list[Path], stack: ExitStack) -> dict[str, tuple[Any, str]]:
    """Open every file and map canonical name -> (open file, key in that file)."""
    sources: dict[str, tuple[Any, str]] = {}
    origin: dict[str, str] = {}
    for file in files:
        try:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            keys = list(handle.keys())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read safetensors file {file}: {exc}") from exc
        for key in keys:
            name = canonical_name(key)
            if name in sources:
                raise CheckpointError(f"tensors {origin[name]!r} and {file.name}:{key!r} both map to {name!r}")
            sources[name] = (handle, key)
            origin[name] = f"{file.name}:{key}"
    return sources


def _get(sources: dict[str, tuple[Any, str]], name: str) -> torch.Tensor:
    handle, key = sources[name]
    try:
        return handle.get_tensor(key)
    except SafetensorError as exc:
        raise CheckpointError(f"cannot read tensor {key!r}: {exc}") from exc


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("tid2eid"):
        return tensor.to(torch.int64)
    if not tensor.is_floating_point():
        return tensor
    return tensor.to(torch.float32 if keeps_fp32(name) else dtype)


def read_checkpoint(
    model_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    experts: Callable[[str], Sequence[int]] | None = None,
    scheme: QuantScheme | None = None,
    quantize: bool = False,
) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint, keyed by canonical name, dequantized and cast to `dtype` on `device`.

    Norms, mHC parameters, sinks, position biases and the router's correction bias stay fp32 (as in HF);
    `tid2eid` is int64. FP8/FP4 weights are paired with their `.scale` / `weight_scale_inv` companions.
    Raises `CheckpointError` (or `CheckpointConfigError`) naming the path or tensor at fault.

    `experts` (expert parallelism): given a stacked prefix (`model.layers.3.mlp.experts`), the logical experts
    this process holds there in slot order (a replica once per slot); only those are read (rows of a stacked
    tensor, or the per-expert tensors named), and the stacked result has one row per slot.

    `scheme` (`stored_scheme`): FP8/FP4 weights stay as stored, their scales under `<name>_scale_inv` (stacked
    with the experts), checked against the scheme's blocks; with `quantize`, plain weights that the scheme stores
    quantized (`quant.quantize_stored`) are quantized as they are read.
    """
    config = read_config(model_dir)
    # dequantized weights use the config's blocks too (a V4.1 checkpoint's 32x32 with quantization 'none')
    block = (scheme or stored_scheme(config, "auto")[0] or QuantScheme()).weight_block
    files = find_weight_files(model_dir)
    stacker = ExpertStacker(config.n_routed_experts if experts is None else None)
    scale_stacker = ExpertStacker(config.n_routed_experts if experts is None else None)
    wanted: dict[str, list[int]] = {}  # prefix -> the distinct experts it holds, ascending (stacker indices)
    state: dict[str, torch.Tensor] = {}

    def put(stacked: dict[str, torch.Tensor]) -> None:
        for key, value in stacked.items():
            quantized = quantize_stored(key, value, scheme) if quantize and scheme is not None else None
            if quantized is not None:
                state[key], state[stored_scale_name(key)] = quantized
            else:
                state[key] = value

    with ExitStack() as stack:
        sources = _open_all(files, stack)
        orphans = [n for n in sources if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] + ".weight" not in sources]
        if orphans:
            raise CheckpointError(f"{model_dir}: scale tensor {orphans[0]!r} has no matching weight")
        names = [n for n in sources if not n.endswith(SCALE_SUFFIX)]
        for name in tqdm(names, desc="Loading weights", unit="tensor", disable=not progress):
            piece = expert_piece(name)
            prefix = piece[0] if piece is not None else name.rpartition(".")[0]
            if experts is not None and (piece is not None or name.endswith(_STACKED)) and prefix not in wanted:
                wanted[prefix] = sorted(set(experts(prefix)))
            if experts is not None and piece is not None:
                if piece[1] not in wanted[prefix]:
                    continue  # another rank's expert: never read
                piece = (prefix, wanted[prefix].index(piece[1]), piece[2])
            scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
            if experts is not None and name.endswith(_STACKED) and scale_name not in sources:
                state[name] = _cast(name, _rows(sources, name, wanted[prefix]).to(device), dtype)
                continue
            tensor = _get(sources, name).to(device)
            if name.endswith(".weight") and scale_name in sources and scheme is not None:  # kept as stored
                scale = _get(sources, scale_name).to(device)
                _check_stored(model_dir, name, tensor, scale, scheme, piece is not None)
                if piece is None:
                    state[name], state[stored_scale_name(name)] = tensor, scale
                else:
                    state.update(stacker.add(*piece, tensor))
                    state.update({stored_scale_name(k): v for k, v in scale_stacker.add(*piece, scale).items()})
                continue
            if name.endswith(".weight") and scale_name in sources:
                try:
                    tensor = dequantize(tensor, _get(sources, scale_name).to(device), block)
                except ValueError as exc:
                    raise CheckpointError(f"{model_dir}: tensor {name!r}: {exc}") from exc
            elif tensor.dtype in _QUANTIZED_DTYPES:
                raise CheckpointError(f"{model_dir}: quantized tensor {name!r} ({tensor.dtype}) has no scale tensor")
            tensor = _cast(name, tensor, dtype)
            if piece is None:
                if experts is not None and name.endswith(_STACKED):  # quantized stacked: read whole, keep rows
                    tensor = tensor[wanted[prefix]]
                put({name: tensor})
            else:
                put(stacker.add(*piece, tensor))
    try:
        put(stacker.finish())
        state.update({stored_scale_name(k): v for k, v in scale_stacker.finish().items()})
    except KeyError as exc:
        raise CheckpointError(f"{model_dir}: {exc.args[0]}") from exc
    for prefix, distinct in wanted.items():  # distinct experts -> one row per slot (replicas repeated)
        slots = [distinct.index(e) for e in experts(prefix)]
        for leaf in _STACKED:
            for key in (f"{prefix}.{leaf.lstrip('.')}", stored_scale_name(f"{prefix}.{leaf.lstrip('.')}")):
                if key in state and slots != list(range(len(distinct))):
                    state[key] = state[key][slots]
    return state


def _check_stored(model_dir, name: str, weight: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme,
                  expert: bool) -> None:
    try:
        block = check_scale(name, weight, scale, scheme)
    except ValueError as exc:
        raise CheckpointError(f"{model_dir}: {exc}") from exc
    if expert and weight.shape[0] % block[0]:  # w1 and w3 rows are stacked: their blocks must not straddle
        raise CheckpointError(f"{model_dir}: {name}: an FP8 expert of {weight.shape[0]} rows cannot be stacked in "
                              f"{block[0]}-row blocks; load it with quantization='none'")


def prepare_stored(module: torch.nn.Module, state: dict[str, torch.Tensor], scheme: QuantScheme) -> int:
    """Give every parameter of `module` whose scales `state` holds (`<name>_scale_inv`) the stored form
    (`common.keep_stored`: FP8 in the scheme's blocks, or packed FP4), before `load_weights`. Returns how many."""
    count = 0
    for name, _ in list(module.named_parameters()):
        scale = state.get(stored_scale_name(name))
        if scale is None:
            continue
        owner_name, _, param = name.rpartition(".")
        data = state[name]
        block = (1, FP4_GROUP) if data.dtype in (torch.int8, torch.uint8) else scheme.weight_block
        keep_stored(module.get_submodule(owner_name), param, data, scale, block)
        count += 1
    return count


#: the stacked routed-expert tensors' leaf names
_STACKED = (".gate_up_proj", ".down_proj")


def _rows(sources: dict[str, tuple[Any, str]], name: str, rows: list[int]) -> torch.Tensor:
    """Only `rows` of a stacked tensor, read through safetensors' slices (the others stay on disk)."""
    handle, key = sources[name]
    try:
        view = handle.get_slice(key)
        return torch.cat([view[r : r + 1] for r in rows]) if rows else _get(sources, name)[:0]
    except SafetensorError as exc:
        raise CheckpointError(f"cannot read tensor {key!r}: {exc}") from exc


def load_weights(module: torch.nn.Module, state: dict[str, torch.Tensor], *, strict_unexpected: bool = False) -> None:
    """Copy `state` into `module`'s parameters and persistent buffers, matched by name.

    Every entry of `module.state_dict()` must be present with the same shape; all are checked before anything
    is copied, so a failed load leaves the module untouched. Extra tensors (e.g. `mtp.*` for a model without
    MTP) are logged, or raise when `strict_unexpected`. Values are cast to each target's dtype.
    """
    targets = module.state_dict(keep_vars=True)
    missing = [name for name in targets if name not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    for name, target in targets.items():
        if state[name].shape != target.shape:
            raise CheckpointError(f"shape mismatch for {name!r}: checkpoint has {tuple(state[name].shape)}, "
                                  f"model expects {tuple(target.shape)}")
    unexpected = sorted(set(state) - set(targets))
    if unexpected:
        listed = ", ".join(unexpected[:8]) + (", ..." if len(unexpected) > 8 else "")
        if strict_unexpected:
            raise CheckpointError(f"checkpoint has {len(unexpected)} tensor(s) the model does not use: {listed}")
        logger.warning("ignoring %d checkpoint tensor(s) the model does not use: %s", len(unexpected), listed)
    with torch.no_grad():
        for name, target in targets.items():
            if target.is_meta:  # (factory.build_model's params_on_meta) the checkpoint's tensor takes its place
                put_tensor(module, name, target, state[name])
            else:
                target.copy_(state[name])


def put_tensor(module: torch.nn.Module, name: str, target: torch.Tensor, value: torch.Tensor) -> None:
    """`value` (cast to `target`'s dtype) as the parameter or buffer `name` of `module`, where `target` is a meta
    tensor standing for it."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    value = value.to(target.dtype)
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value
