"""Host buffers for the ssd engine: views of tensors' bytes with the least per-object overhead."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tierkv.buffers import Parts, host_copy


def _host_view(p: torch.Tensor) -> memoryview:
    if p.device.type != "cpu":
        p = p.cpu()
    return memoryview(p.contiguous().numpy()).cast("B")  # type: ignore[arg-type]  # ndarray exports a buffer


_CTYPES: dict[int, type[ctypes.Array[ctypes.c_ubyte]]] = {}


def cbuffer(p: torch.Tensor):
    """A writable buffer over a contiguous host tensor's bytes, or None for any other tensor.

    Cheaper than a numpy view: per-object overhead decides small-object throughput.
    """
    if not p.is_cpu or not p.is_contiguous():
        return None
    return ctype_of(p.nbytes).from_address(p.data_ptr())


def ctype_of(n: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    """``ctypes.c_ubyte * n``, made once per length (a few lengths are in use at a time)."""
    typ = _CTYPES.get(n)
    if typ is None:
        if len(_CTYPES) > 256:
            _CTYPES.clear()
        typ = _CTYPES[n] = ctypes.c_ubyte * n
    return typ


def image_address(image) -> tuple[int, object]:
    """(address, keeper) of an image buffer; the keeper holds the export the address relies on."""
    keeper = ctypes.c_char.from_buffer(image)
    return ctypes.addressof(keeper), keeper


def scatter(src, parts: Parts) -> None:
    arr = torch.from_numpy(np.frombuffer(src, dtype=np.uint8))
    pos = 0
    for p in parts:
        n = p.numel()
        host_copy(p, arr[pos:pos + n])
        pos += n


