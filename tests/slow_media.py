"""A DRAM tier whose reads can be slowed from outside: a slow medium for the decline rule's tests.

``{"medium": "slow_media:SlowDRAM", "slow_on": PATH, "slow_off": PATH, "read_delay_s": 0.3, ...}`` (the
rest as ``dram`` takes): every read sleeps ``read_delay_s`` first while the file ``slow_on`` exists and
``slow_off`` does not (a test turns the delay on, then off, by creating files).
"""

from __future__ import annotations

import os
import time
from typing import Any

from tierkv.tiers.dram import DRAMTier


class SlowDRAM(DRAMTier):
    medium = "slow_dram"

    slow_on: str = ""
    slow_off: str = ""
    read_delay_s: float = 0.0
    slowed = 0

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> SlowDRAM:
        opts = dict(options)
        on, off, delay = opts.pop("slow_on"), opts.pop("slow_off"), float(opts.pop("read_delay_s"))
        tier = super().from_config(name, opts)
        assert isinstance(tier, SlowDRAM)
        tier.slow_on, tier.slow_off, tier.read_delay_s = on, off, delay
        return tier

    def _pause(self) -> None:
        if os.path.exists(self.slow_on) and not os.path.exists(self.slow_off):
            self.slowed += 1
            time.sleep(self.read_delay_s)

    def read(self, *args: Any, **kwargs: Any) -> list[bool]:
        self._pause()
        return super().read(*args, **kwargs)

    def read_at(self, *args: Any, **kwargs: Any) -> Any:
        self._pause()
        return super().read_at(*args, **kwargs)
