"""Checks of the NVIDIA kernels on the CPU under Triton's interpreter, for the CPU suite's test files that run them.

The interpreter must be chosen before triton is first imported (its own helpers are kernels made at import), so
such a test file runs itself as a script in one child process started with TRITON_INTERPRET=1 (`child_main`: the
interpreter made able to run the kernels, then the file's checks, their results printed as JSON), and its tests
read the results (`run_child`, from a module-scoped fixture). Where a GPU is present the checks run for real
under tests/gpu/ instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def run_child(test_file: str, *args, timeout: float, gpu_twin: str) -> dict:
    """Run `test_file` as a script under the interpreter with `args`; its printed results. Skips on a GPU
    machine, naming `gpu_twin`, where the same checks run on the device."""
    if torch.cuda.is_available():
        pytest.skip(f"with a GPU these run as {gpu_twin}")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(test_file), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=Path(test_file).parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_main(run_cases: Callable[..., dict], *args) -> None:
    """The child's body: one thread, the interpreter fixed up for the kernels (numpy >= 2.4, libdevice math, the
    autotuner, bf16 dots: `deepserve.backends.nvidia.interpreted`), then `run_cases(*args)` printed as JSON."""
    from deepserve.backends.nvidia.interpreted import support_kernels

    torch.set_num_threads(1)
    support_kernels()
    print(json.dumps(run_cases(*args)))
