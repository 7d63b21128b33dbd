"""Media that lie, for ``tierkv bench --config`` tests: a benchmark must fail on each, never report a figure.

``RefusingTier`` stores nothing; ``FlippingTier`` stores the bytes but flips one on every read;
``SilentTier`` answers True to a read without writing the destination; ``DiskFullTier`` refuses every write
as a full device (its ``enospc`` counter grows); ``BrokenTier`` cannot be built.
"""

from __future__ import annotations

import torch
from fake_media import read_objects

from tierkv.tiers.base import Tier


class _DictTier(Tier):
    medium = "dict"

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self.data: dict[str, torch.Tensor] = {}

    def _write(self, keys, srcs):
        for k, parts in zip(keys, srcs):
            self.data[k] = torch.cat([p.reshape(-1) for p in parts]).clone()
        return [True] * len(keys)

    def _read(self, keys, dsts):
        return read_objects(self.data.get, keys, dsts)

    def _delete(self, keys):
        for k in keys:
            self.data.pop(k, None)

    def _contains(self, keys):
        return [k in self.data for k in keys]

    @property
    def used_bytes(self):
        return sum(v.numel() for v in self.data.values())


class RefusingTier(_DictTier):
    medium = "refusing"

    def _write(self, keys, srcs):
        return [False] * len(keys)


class FlippingTier(_DictTier):
    medium = "flipping"

    def _read(self, keys, dsts):
        out = super()._read(keys, dsts)
        for ok, parts in zip(out, dsts):
            if ok:
                parts[0].view(-1)[7] ^= 0x20
        return out


class SilentTier(_DictTier):
    medium = "silent"

    def _read(self, keys, dsts):
        return [k in self.data for k in keys]


class BrokenTier(_DictTier):
    medium = "broken"

    def __init__(self, name: str, capacity_bytes: int) -> None:
        raise RuntimeError("the medium's device is gone")


class DiskFullTier(_DictTier):
    """Refuses every write as a full device does, and counts it (``enospc``) as the ``ssd`` tier does."""

    medium = "disk_full"

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self.enospc = 0

    def _write(self, keys, srcs):
        self.enospc += len(keys)
        return [False] * len(keys)

    def extra_stats(self):
        return {"enospc": self.enospc}
