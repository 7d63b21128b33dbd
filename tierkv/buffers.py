"""Turning callers' tensors into byte parts, and copying between part lists.

An object's bytes are given as *parts*: a list of one-dimensional, contiguous
``torch.uint8`` tensors whose concatenation is the object.  A single tensor is one
part; an engine that keeps one tensor per layer passes one part per layer and
nothing is gathered into a staging copy first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

from .errors import BufferSizeError

Parts = list[torch.Tensor]
Value = Union[torch.Tensor, Sequence[torch.Tensor]]


def as_bytes(t: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy); raises if not contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    if t.dtype == torch.uint8 and t.dim() == 1:
        return t
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def to_parts(value: Value, what: str = "value") -> tuple[Parts, int]:
    """Normalise a tensor or a sequence of tensors to (parts, total nbytes)."""
    if isinstance(value, torch.Tensor):
        p = as_bytes(value, what)
        return [p], p.numel()
    if isinstance(value, (list, tuple)) and value:
        parts = [as_bytes(v, f"{what} part {i}") for i, v in enumerate(value)]
        return parts, sum(p.numel() for p in parts)
    raise TypeError(f"{what} must be a torch.Tensor or a non-empty list of tensors, got {type(value).__name__}")


def parts_nbytes(parts: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() for p in parts)


def check_size(key: str, parts_n: int, stored_n: int) -> None:
    if parts_n != stored_n:
        raise BufferSizeError(f"buffer for key {key[:16]}… holds {parts_n} bytes but the stored chunk has {stored_n}")


def copy_parts(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy the concatenation of ``src`` into the concatenation of ``dst`` (same total)."""
    if len(dst) == 1 and len(src) == 1:
        dst[0].copy_(src[0])
        return
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        d, s = dst[di], src[si]
        n = min(d.numel() - doff, s.numel() - soff)
        if n:
            d[doff:doff + n].copy_(s[soff:soff + n])
        doff += n
        soff += n
        if doff == d.numel():
            di, doff = di + 1, 0
        if soff == s.numel():
            si, soff = si + 1, 0


def staging(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A host buffer for moving a chunk between tiers."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if pin:
        try:
            t = t.pin_memory()
        except RuntimeError:  # no accelerator runtime: pinning is impossible and unnecessary
            pass
    return t
