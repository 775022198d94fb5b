"""The NVIDIA backend (CUDA GPUs). `NvidiaBackend` is imported on first use, so importing this package (as the
plugin manager does) stays free of torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .backend import NvidiaBackend

__all__ = ["NvidiaBackend"]


def __getattr__(name: str) -> Any:
    if name == "NvidiaBackend":
        from .backend import NvidiaBackend

        return NvidiaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
