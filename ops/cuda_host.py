"""A host function in a CUDA stream (`cuLaunchHostFunc`): the driver calls a native function when the work
queued before it is done, and the stream goes on when it returns. Captured in a CUDA graph it becomes a
host node, so a replayed graph hands work to the CPU without Python. The function must be native code
(it runs on a driver thread, must not call CUDA) and its argument must outlive every launch and graph."""

from __future__ import annotations

import ctypes
from functools import cache

import torch


@cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    return lib


def launch_host_func(stream: torch.cuda.Stream, function: int, argument: int) -> None:
    """Queue `function(argument)` (addresses) on `stream`; raises on a CUDA error."""
    rc = _driver().cuLaunchHostFunc(stream.cuda_stream, function, argument)
    if rc:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")
