"""Built-in plugin: the Ascend backend, when asked for by name or when `auto` finds torch_npu installed."""

from __future__ import annotations

import importlib.util

from deepserve.core.config import EngineConfig
from deepserve.core.hookspecs import hookimpl
from deepserve.core.interfaces import Backend


def _wanted(config: EngineConfig) -> bool:
    if config.accelerator == "ascend":
        return True  # asked for by name: build it, and let its clear error through if torch_npu is missing
    on_auto = config.accelerator == "auto" and (config.device or "npu").startswith("npu")
    return on_auto and importlib.util.find_spec("torch_npu") is not None


@hookimpl
def deepserve_select_backend(config: EngineConfig) -> Backend | None:
    if not _wanted(config):
        return None
    from deepserve.backends.ascend import AscendBackend

    return AscendBackend(device=config.device or "npu:0")
