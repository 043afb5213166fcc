"""Argument checks shared by the typed launchers of the expert kernels."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:<current>`, so that devices compare equal to tensors' devices."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != resolve(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def check_vector(name: str, t: torch.Tensor, length: int, dtypes: tuple[torch.dtype, ...],
                 device: torch.device) -> None:
    check_device(name, t, device)
    if t.dim() != 1 or t.shape[0] != length or t.dtype not in dtypes or (length > 1 and t.stride(0) != 1):
        raise ValueError(f"{name}: expected contiguous [{length}] of {dtypes}, got {t.dtype} {tuple(t.shape)}")


def check_rows(name: str, t: torch.Tensor, shape: tuple[int, int], dtypes: tuple[torch.dtype, ...],
               device: torch.device) -> None:
    """A 2-D tensor of the given shape whose rows are contiguous (any row stride)."""
    check_device(name, t, device)
    if t.dim() != 2 or tuple(t.shape) != shape or t.dtype not in dtypes:
        raise ValueError(f"{name}: expected {shape} of {dtypes}, got {t.dtype} {tuple(t.shape)}")
    if shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous, got strides {t.stride()}")
