"""The Ascend backend: the reference ops on an NPU through torch_npu. Designed; untested without hardware."""

from __future__ import annotations

import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.interfaces import BackendUnavailable


class AscendBackend(ReferenceBackend):
    """Backend for Huawei Ascend NPUs.

    Designed, and untested: no Ascend hardware has run it. It runs the pure-PyTorch reference ops on the NPU
    that `torch_npu` (Huawei's PyTorch adapter) exposes as the `npu` device; NPU-specific ops replace them
    later, each checked against the reference.

    Raises `BackendUnavailable` when torch_npu is not installed or sees no NPU.
    """

    name = "ascend"

    def __init__(self, device: str = "npu:0") -> None:
        try:
            import torch_npu  # noqa: F401  (importing it registers the `npu` device type with torch)
        except ImportError as exc:
            raise BackendUnavailable(
                "the ascend backend needs torch_npu, but torch_npu is not installed "
                f"({exc}); install the torch_npu build matching torch {torch.__version__} and your CANN "
                "toolkit, or use accelerator 'cpu' or 'nvidia'"
            ) from exc
        if not torch.npu.is_available():
            raise BackendUnavailable("torch_npu is installed but sees no Ascend NPU: torch.npu.is_available() is False")
        if not device.startswith("npu"):
            raise BackendUnavailable(f"the ascend backend runs on an npu device, not {device!r}")
        super().__init__(device=device)
