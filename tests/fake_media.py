"""One in-memory fake medium for the store's tests: every fault and timing a test needs, as a switch.

``FakeTier`` keeps objects in a dict (copies, never the caller's buffers) and
implements the medium hooks of ``tiers/base.py``, so the base class's contract
checks run as for any medium.  Switches:

* ``managed`` — False makes it a shared pool (the store asks it about presence);
* ``up`` — False: unavailable, every call a miss;
* ``fail_writes`` / ``fail_reads`` — the medium raises (a device error);
* ``gate`` / ``gate_writes`` — reads (and writes, unless ``gate_writes`` is False)
  wait at the gate, and ``entered`` is set, to freeze a call mid-flight;
* ``overhead`` — bytes each object costs beyond its own (``footprint``);
* ``persistent`` — the store treats it as a persistent tier (write-behind).
"""

from __future__ import annotations

import threading

import torch

from tierkv.tiers.base import Tier


def read_objects(find, keys, dsts) -> list[bool]:
    """Each key's stored tensor (``find(key)``, None when absent) copied into its parts in order; False where
    absent or of another size (a test medium never hands back bytes that do not fit)."""
    out = []
    for k, parts in zip(keys, dsts):
        v = find(k)
        if v is None or v.numel() != sum(p.numel() for p in parts):
            out.append(False)
            continue
        pos = 0
        for p in parts:
            p.copy_(v[pos:pos + p.numel()])
            pos += p.numel()
        out.append(True)
    return out

class FakeTier(Tier):
    medium = "fake"

    def __init__(self, name: str = "fake", capacity_bytes: int = 1 << 30, *, managed: bool = True,
                 persistent: bool = False, overhead: int = 0) -> None:
        super().__init__(name, capacity_bytes)
        self.managed = managed  # type: ignore[misc]  (a per-instance switch of the class attribute)
        self.persistent = persistent  # type: ignore[misc]
        self.overhead = overhead
        self.data: dict[str, torch.Tensor] = {}
        self.up = True
        self.fail_writes = False
        self.fail_reads = False
        self.gate = threading.Event()
        self.gate.set()
        self.gate_writes = True
        self.entered = threading.Event()
        self.calls = 0

    def footprint(self, nbytes: int) -> int:
        return nbytes + self.overhead

    def _wait(self) -> None:
        self.entered.set()
        self.gate.wait(10)

    def _write(self, keys, srcs):
        self.calls += 1
        if self.gate_writes:
            self._wait()
        if self.fail_writes:
            raise OSError("fake medium: write failed")
        if not self.up:
            return [False] * len(keys)
        for k, parts in zip(keys, srcs):
            self.data.setdefault(k, torch.cat([p.reshape(-1).cpu() for p in parts]).clone())
        return [True] * len(keys)

    def _read(self, keys, dsts):
        self.calls += 1
        self._wait()
        if self.fail_reads:
            raise OSError("fake medium: read failed")
        return read_objects(lambda k: self.data.get(k) if self.up else None, keys, dsts)

    def _delete(self, keys):
        for k in keys:
            self.data.pop(k, None)

    def _contains(self, keys):
        self.calls += 1
        return [self.up and k in self.data for k in keys]

    @property
    def available(self):
        return self.up and not self._closed

    @property
    def used_bytes(self):
        return sum(v.numel() for v in self.data.values())
