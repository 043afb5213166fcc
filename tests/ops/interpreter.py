"""Kernel checks under Triton's interpreter, for machines without CUDA.

TRITON_INTERPRET=1 must be set before Triton compiles anything, so a test module's checks run in a
subprocess: its test calls `run_interpreted(__file__, checks)`, which starts the module with
`--interpret`, and the module ends with `sys.exit(interpret_main(checks))` under that flag. Each check
takes a fresh seed and may return its measured error; one `ok` line is printed per check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
Check = tuple[str, Callable[[int], object]]  # (name, check(seed) -> error or None)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the gpu tests run the kernels")


def run_interpreted(module: str, checks: Sequence[Check], timeout: float = 300, **environ: str) -> None:
    """The module's checks in a subprocess under the interpreter, with `environ` added to its environment."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), **environ)
    result = subprocess.run([sys.executable, module, "--interpret"], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("ok ") == len(checks), result.stdout


def interpret_main(checks: Sequence[Check]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    seed = int.from_bytes(os.urandom(4), "little")
    for index, (name, check) in enumerate(checks):
        start = time.perf_counter()
        error = check(seed + index)
        shown = f" error={error:.1e}" if isinstance(error, float) else ""
        print(f"ok {name}{shown} ({time.perf_counter() - start:.2f} s)", flush=True)
    return 0
