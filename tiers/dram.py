"""``dram``: a preallocated pool of host memory, pinned when an accelerator is present."""

from __future__ import annotations

from typing import Any

import torch

from tierkv.options import pop_bool

from .slab import SlabTier


class DRAMTier(SlabTier):
    """Host memory pool; pinned (page-locked) when a device runtime exists, for fast H2D/D2H."""

    medium = "dram"
    #: a checked read by the store's vouched path sums each chunk as it copies it (``SlabTier.read_at``)
    sums_copies = True

    def __init__(self, name: str, capacity_bytes: int, pin_memory: bool | None = None, prefault: bool = True) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available() or hasattr(torch, "npu")
        super().__init__(name, capacity_bytes, device="cpu", pin_memory=pin_memory, prefault=prefault)

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "DRAMTier":
        capacity = cls.pop_capacity(name, options)
        what = f"tier {name!r}"
        pin = pop_bool(options, "pin_memory", None, what)
        prefault = pop_bool(options, "prefault", True, what)
        cls.reject_unknown(name, options)
        return cls(name, capacity, pin_memory=pin, prefault=prefault)
