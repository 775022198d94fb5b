"""The reference backend: every op in plain PyTorch, on any device torch supports."""

from .ops import ReferenceBackend

__all__ = ["ReferenceBackend"]
