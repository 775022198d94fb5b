"""Built-in plugin: the NVIDIA backend, when asked for by name or when `auto` finds a CUDA GPU."""

from __future__ import annotations

from deepserve.core.config import EngineConfig
from deepserve.core.hookspecs import hookimpl
from deepserve.core.interfaces import Backend


def _wanted(config: EngineConfig) -> bool:
    if config.accelerator == "nvidia":
        return True  # asked for by name: build it, and let its clear error through if there is no GPU
    on_auto = config.accelerator == "auto" and (config.device or "cuda").startswith("cuda")
    if not on_auto:
        return False
    import torch

    return torch.cuda.is_available()


@hookimpl
def deepserve_select_backend(config: EngineConfig) -> Backend | None:
    if not _wanted(config):
        return None
    from deepserve.backends.nvidia import NvidiaBackend

    # batch_invariant=True: the kernels with fixed tiles and reduction orders, the rest the reference's exact ops
    # (NvidiaBackend(invariant=True)); else the kernels as fast as they go
    return NvidiaBackend(device=config.device or "cuda:0", invariant=config.batch_invariant is True)
