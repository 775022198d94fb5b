"""The reference backend: every op in plain PyTorch, on any device torch supports.

`ReferenceBackend` loads on first use, so registering this package's plugin does not import torch.
"""

from typing import Any

__all__ = ["ReferenceBackend"]


def __getattr__(name: str) -> Any:
    if name == "ReferenceBackend":
        from .ops import ReferenceBackend

        return ReferenceBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
