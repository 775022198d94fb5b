"""The one place deepserve reads its environment variables.

Every variable is named `DEEPSERVE_*`. Some also accept the name DeepSeek's DeepInfer uses, so a DeepInfer
deployment's environment keeps working; when both are set, the `DEEPSERVE_*` name wins. A variable that is
set, even to an empty string, counts as set (an empty `DEEPSERVE_PLUGINS` means "no third-party plugins").
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One environment variable deepserve reads: its name, an optional DeepInfer alias, and what it does."""

    name: str
    alias: str | None
    help: str


ENV_VARS: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar(
            "DEEPSERVE_ACCELERATOR",
            "DEEPINFER_ACCELERATOR",
            "Force an accelerator backend (`cpu`, `nvidia`, `ascend` or a plugin's name) when the engine "
            "config says `auto`. An explicit accelerator in the config wins over this variable.",
        ),
        EnvVar(
            "DEEPSERVE_API_KEY",
            None,
            "API key that `deepserve serve` requires on its /v1 routes (Authorization: Bearer or x-api-key), "
            "when --api-key is not given.",
        ),
        EnvVar(
            "DEEPSERVE_DIST_BACKEND",
            None,
            "The torch.distributed backend of data- and expert-parallel ranks: `nccl` or `gloo` (default: NCCL "
            "where CUDA GPUs are visible, else gloo; NCCL without a GPU is refused). docs/distributed.md.",
        ),
        EnvVar(
            "DEEPSERVE_BATCH_INVARIANT",
            None,
            "`1`: batch-invariant ops on every backend (NVIDIA: its reference ops on the GPU, slow); `0`: the "
            "fastest ops (the CPU reference on torch's kernels, not batch-invariant), when the engine option "
            "`batch_invariant` is not given. Unset: each backend's default (CPU exact, NVIDIA fast).",
        ),
        EnvVar(
            "DEEPSERVE_CACHE_DIR",
            None,
            "Where deepserve keeps what a restart reuses: compiled kernels (Triton's cache goes to `triton/` under "
            "it unless `TRITON_CACHE_DIR` is set, DeepGEMM's JIT cache to `deep_gemm/` unless `DG_JIT_CACHE_DIR` "
            "is). Default `$XDG_CACHE_HOME/deepserve` (`~/.cache/deepserve`).",
        ),
        EnvVar(
            "DEEPSERVE_ENGINE_PROCESS",
            None,
            "`1`: the engine runs in a process of its own behind a front (vLLM's multiprocessing engine core), so "
            "the server's Python does not share its GIL; `0`: in the caller's process (the default), when the "
            "engine option `engine_process` / `--engine-process` is not given. docs/distributed.md.",
        ),
        EnvVar(
            "DEEPSERVE_GC_FREEZE",
            None,
            "`0`: leave Python's garbage collector alone. By default an engine, once built, freezes the objects "
            "alive then (`gc.freeze`, as vLLM does) so that a full collection during serving walks only what "
            "requests allocate, and unfreezes them when it shuts down (`gc.unfreeze`: everything frozen, a "
            "caller's own `gc.freeze` included).",
        ),
        EnvVar(
            "DEEPSERVE_MODEL",
            "DEEPINFER_HF_MODEL_DIR",
            "Default model directory (Hugging Face layout: config.json, tokenizer.json, *.safetensors).",
        ),
        EnvVar(
            "DEEPSERVE_SPECULATIVE_CONFIG",
            None,
            "Speculative decoding when `LLM(speculative_config=...)` / `--speculative-config` is not given: JSON "
            "such as `{\"method\": \"mtp\", \"num_speculative_tokens\": 5}` (methods: `mtp`, `dspark`).",
        ),
        EnvVar(
            "DEEPSERVE_VENDOR_KERNELS",
            None,
            "`0` keeps the NVIDIA backend off vendor kernels (DeepGEMM from `sgl-deep-gemm`) even where they are "
            "installed and load; its Triton kernels then run every op.",
        ),
        EnvVar(
            "DEEPSERVE_PLUGINS",
            None,
            "Allowlist of third-party plugins: comma-separated distribution or entry-point names. Unset loads "
            "every installed plugin, an empty string loads none. Built-in plugins always load.",
        ),
    )
}


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of the deepserve variable `name` (a key of `ENV_VARS`), falling back to its DeepInfer alias.

    Returns None when neither is set. `environ` defaults to `os.environ`. An unknown `name` raises KeyError,
    so a misspelt variable fails loudly instead of reading as unset.
    """
    try:
        var = ENV_VARS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a deepserve environment variable; known: {sorted(ENV_VARS)}") from None
    environ = os.environ if environ is None else environ
    if var.name in environ:
        return environ[var.name]
    if var.alias is not None and var.alias in environ:
        return environ[var.alias]
    return None


def default_model_dir() -> str | None:
    """The model used when none is named: `DEEPSERVE_MODEL` (or `DEEPINFER_HF_MODEL_DIR`), else the embedded
    default model shipped inside the package (`deepserve/assets/deepserve-tiny-v4`), else None."""
    named = env_value("DEEPSERVE_MODEL")
    if named:
        return named
    embedded = Path(__file__).resolve().parents[1] / "assets" / "deepserve-tiny-v4"
    return str(embedded) if (embedded / "config.json").is_file() else None


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`DEEPSERVE_CACHE_DIR`, else `deepserve` under `XDG_CACHE_HOME` (else `~/.cache`). Not created here."""
    environ = os.environ if environ is None else environ
    named = env_value("DEEPSERVE_CACHE_DIR", environ)
    if named:
        return Path(named).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "deepserve"


def gc_freeze_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """`DEEPSERVE_GC_FREEZE`: on unless set to `0` (or `false`, `no`, `off`)."""
    value = env_value("DEEPSERVE_GC_FREEZE", environ)
    return value is None or value.strip().lower() not in ("0", "false", "no", "off")
