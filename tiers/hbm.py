"""``hbm``: device memory (``npu`` through torch_npu, ``cuda``, or ``cpu`` for tests)."""

from __future__ import annotations

from typing import Any

import torch

from tierkv.errors import ConfigError, install_hint
from tierkv.options import pop_bool, pop_str

from .base import Locality
from .slab import SlabTier


def resolve_device(device: str) -> torch.device:
    """A torch device for ``device``, importing torch_npu for ``npu``; ConfigError if unusable."""
    if str(device).split(":")[0] == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except ImportError as e:
            raise ConfigError(f"device {device!r} needs torch_npu, which is not installed ({install_hint('npu')}): "
                              f"{e}") from e
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    return dev


class HBMTier(SlabTier):
    """A preallocated pool of device memory."""

    medium = "hbm"
    locality = Locality.DEVICE

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "HBMTier":
        capacity = cls.pop_capacity(name, options)
        what = f"tier {name!r}"
        device = pop_str(options, "device", None, what)
        if device is None:
            device = "npu" if _has_npu() else ("cuda" if torch.cuda.is_available() else "cpu")
        prefault = pop_bool(options, "prefault", True, what)
        cls.reject_unknown(name, options)
        return cls(name, capacity, device=str(resolve_device(device)), prefault=prefault)


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())  # type: ignore[attr-defined]  # torch_npu adds it
