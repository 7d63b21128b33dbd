"""Hypothesis stateful test: the store against a plain dict.

Random put / get / remove / lookup over three small tiers (HBM, DRAM, SSD).
Model: ``stored`` maps a key to the bytes last acknowledged for it.  The store
may forget a chunk (it is a cache: the last tier drops what nobody takes), but
it never returns a wrong byte, and after every step the invariants hold.
"""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv import TieredStore
from tierkv.tiers.slab import ALIGN

KEYS = [f"key{i:02d}" for i in range(24)]
SIZES = [ALIGN, 3 * ALIGN, 5 * ALIGN - 17]


def content(key: str, size: int) -> torch.Tensor:
    seed = int(key[3:]) * 1000 + size
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tierkv-model-")
        self.cfg = {
            "tiers": [
                {"medium": "hbm", "device": "cpu", "capacity": 8 * ALIGN, "eviction": "lru"},
                {"medium": "dram", "capacity": 12 * ALIGN, "eviction": "s3fifo"},
                {"medium": "ssd", "path": self.dir, "capacity": 6 * 4096, "eviction": "arc",
                 "compression": "lz4"},
            ],
            "promotion": {"policy": "on-hit", "min_hits": 1},
        }
        self.store = TieredStore.from_config(self.cfg)
        self.size_of: dict[str, int] = {}  # a key's content is fixed: content addressed
        self.acked: set[str] = set()

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4), size=st.sampled_from(SIZES))
    def put(self, ks, size):
        sizes = [self.size_of.setdefault(k, size) for k in ks]
        ok = self.store.put(ks, [content(k, n) for k, n in zip(ks, sizes)])
        assert len(ok) == len(ks)
        for k, good in zip(ks, ok):
            if good:
                self.acked.add(k)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def get(self, ks):
        ks = [k for k in ks if k in self.size_of]
        if not ks:
            return
        outs = [torch.full((self.size_of[k],), 7, dtype=torch.uint8) for k in ks]
        present = self.store.contains(ks)
        found = self.store.get(ks, outs)
        for k, p, f, o in zip(ks, present, found, outs):
            if f:
                assert k in self.acked, "a hit for a key never stored"
                assert torch.equal(o, content(k, self.size_of[k])), "wrong bytes"
            assert f == p, "get disagrees with presence seen just before"

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def remove(self, ks):
        self.store.remove(ks)
        assert self.store.contains(ks) == [False] * len(ks)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def lookup(self, ks):
        n = self.store.lookup(ks)
        present = self.store.contains(ks)
        expect = 0
        for p in present:
            if not p:
                break
            expect += 1
        assert n == expect

    @precondition(lambda self: bool(self.acked))
    @rule()
    def restart(self):
        """Close and reopen: the SSD tier's chunks survive; nothing wrong appears."""
        ssd = self.store.levels[2]
        self.store.drain_write_behind()
        on_ssd = {k for k, e in ssd.items() if e.ready}
        self.store.close()
        self.store = TieredStore.from_config(self.cfg)
        after = {k for k, t in zip(KEYS, self.store.locate(KEYS)) if t is not None}
        assert after == on_ssd, "a restart keeps exactly what the ssd tier held"

    @invariant()
    def capacity_never_exceeded(self):
        for name, t in self.store.stats()["tiers"].items():
            assert t["used_bytes"] <= t["capacity_bytes"], name
            assert t["stored_bytes"] <= t["capacity_bytes"], name

    @invariant()
    def index_matches_media(self):
        self.store.drain_write_behind()
        for lvl in self.store.levels:
            ready = [k for k, e in lvl.items() if e.ready]
            assert all(lvl.tier.contains(ready)), lvl.name
            assert not lvl.pinned, "a pin outlived its call"
            assert lvl.used == sum(e.footprint for _, e in lvl.items())
            assert len(lvl.eviction) == len(ready)


StoreMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestStoreModel = StoreMachine.TestCase
