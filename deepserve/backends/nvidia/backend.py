"""The NVIDIA backend: the reference ops on a CUDA device, until the kernels arrive."""

from __future__ import annotations

import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.interfaces import BackendUnavailable


class NvidiaBackend(ReferenceBackend):
    """Backend for NVIDIA GPUs (Hopper H100/H200 and Blackwell).

    For now this runs the pure-PyTorch reference ops on the GPU: correct, not fast. The Triton kernels and the
    FlashMLA / DeepGEMM / DeepEP paths arrive in a later issue and will override the ops they cover, one by
    one, each checked against the reference.

    Raises `BackendUnavailable` when torch sees no CUDA device, or `device` is not one it sees.
    """

    name = "nvidia"

    def __init__(self, device: str = "cuda:0") -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "the nvidia backend needs a CUDA GPU, but torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
                "use accelerator 'cpu' or 'auto', or install a CUDA build of torch"
            )
        dev = torch.device(device)
        if dev.type != "cuda":
            raise BackendUnavailable(f"the nvidia backend runs on a cuda device, not {device!r}")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise BackendUnavailable(
                f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
        super().__init__(device=f"cuda:{index}")
        self.device_name: str = torch.cuda.get_device_name(index)
        self.compute_capability: tuple[int, int] = torch.cuda.get_device_capability(index)

    def __repr__(self) -> str:
        major, minor = self.compute_capability
        return f"NvidiaBackend(device={self.device!r}, gpu={self.device_name!r}, sm_{major}{minor})"
