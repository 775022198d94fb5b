"""Triton kernels of the NVIDIA backend. Importing this package needs `triton`; `NvidiaBackend` imports it only
when triton is installed, so the backend (and CPU CI) work without it."""
