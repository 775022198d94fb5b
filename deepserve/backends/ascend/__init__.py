"""The Ascend backend (Huawei NPUs through torch_npu). `AscendBackend` is imported on first use, so importing
this package (as the plugin manager does) needs neither torch nor torch_npu."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .backend import AscendBackend

__all__ = ["AscendBackend"]


def __getattr__(name: str) -> Any:
    if name == "AscendBackend":
        from .backend import AscendBackend

        return AscendBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
