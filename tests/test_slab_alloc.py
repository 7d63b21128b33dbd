"""The slab allocator's invariants, by property tests: live objects never overlap, the
accounting is exact, and any mix of sizes whose footprints fit is always placed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.slab_alloc import ALIGN, SlabAllocator, align_up

UNITS = 96  # slab of 96 granules: small enough that every path (carve, larger slot, gather) is hit


class Model:
    """The allocator beside an ownership map of every granule."""

    def __init__(self, units: int = UNITS, slot_max: int = 8 * ALIGN, run_bytes: int = 6 * ALIGN) -> None:
        self.size = units * ALIGN
        self.a = SlabAllocator(self.size, slot_max=slot_max, run_bytes=run_bytes)
        self.owner = np.zeros(units, dtype=np.int64)  # 0 = free, else object id
        self.live: dict[int, tuple[int, object]] = {}
        self.next_id = 1

    def used(self) -> int:
        return sum(f for f, _ in self.live.values())

    def alloc(self, f: int) -> bool:
        loc = self.a.allocate(f)
        fits = f <= self.size - self.used()
        if loc is None:
            assert not fits, f"allocate({f}) failed with {self.size - self.used()} bytes free"
            return False
        pieces = SlabAllocator.pieces(f, loc)
        assert sum(n for _, n in pieces) == f
        oid = self.next_id
        self.next_id += 1
        for off, n in pieces:
            assert off % ALIGN == 0 and n % ALIGN == 0 and n > 0 and off >= 0 and off + n <= self.size
            span = self.owner[off // ALIGN:(off + n) // ALIGN]
            assert not span.any(), f"object {oid} overlaps live objects {set(span[span > 0].tolist())}"
            span[:] = oid
        self.live[oid] = (f, loc)
        self.check()
        return True

    def free(self, oid: int) -> None:
        f, loc = self.live.pop(oid)
        for off, n in SlabAllocator.pieces(f, loc):
            assert (self.owner[off // ALIGN:(off + n) // ALIGN] == oid).all()
            self.owner[off // ALIGN:(off + n) // ALIGN] = 0
        self.a.free(f, loc)
        self.check()

    def check(self) -> None:
        assert self.a.free_bytes + self.used() == self.size
        assert int((self.owner == 0).sum()) * ALIGN == self.a.free_bytes


footprints = st.integers(1, 24).map(lambda u: u * ALIGN)
ops = st.lists(st.one_of(st.tuples(st.just("alloc"), footprints),
                         st.tuples(st.just("free"), st.integers(0, 10**6))), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(footprints, max_size=60))
def test_any_history_then_fill_to_capacity(history, fill):
    m = Model()
    for op, arg in history:
        if op == "alloc":
            m.alloc(arg)
        elif m.live:
            m.free(sorted(m.live)[arg % len(m.live)])
    # whatever the fragmentation, any mix of sizes that fits is placed, to the last byte
    for f in fill:
        if f <= m.a.free_bytes:
            assert m.alloc(f)
    while m.a.free_bytes:
        assert m.alloc(min(m.a.free_bytes, 5 * ALIGN))
    assert m.a.allocate(ALIGN) is None
    for oid in list(m.live):  # and everything comes back
        m.free(oid)
    assert m.a.free_bytes == m.size


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "del"]), st.integers(0, 15), st.integers(0, 700)), max_size=80))
def test_slab_tier_bytes_and_accounting_under_churn(ops_):
    cap = 64 * ALIGN * 4
    t = DRAMTier("d", cap)
    model: dict[str, torch.Tensor] = {}
    try:
        for op, k, n in ops_:
            key = f"key{k}"
            if op == "put":
                val = torch.randint(0, 256, (n,), dtype=torch.uint8)
                # a rewrite places the new value beside the old one, and frees the old one only once the
                # new one is in place: it needs room for both, and a rewrite that fails keeps the old value
                fits = sum(t.footprint(v.numel()) for v in model.values()) + t.footprint(n) <= cap
                ok = t.write([key], [[val]])[0]
                assert ok == fits
                if ok:
                    model[key] = val
            else:
                t.delete([key])
                model.pop(key, None)
            assert t.used_bytes == sum(v.numel() for v in model.values())
            assert t._alloc.free_bytes == cap - sum(t.footprint(v.numel()) for v in model.values())
        for key, val in model.items():  # every object reads back exact, also split into two parts
            half = val.numel() // 2
            a, b = torch.empty(half, dtype=torch.uint8), torch.empty(val.numel() - half, dtype=torch.uint8)
            assert t.read([key], [[a, b]]) == [True]
            assert torch.equal(torch.cat([a, b]), val)
    finally:
        t.close()


def test_common_sizes_take_one_slot_each_and_reuse_freed_slots():
    a = SlabAllocator(1 << 20)
    f = align_up(200)
    locs = [a.allocate(f) for _ in range(100)]
    assert all(type(x) is int for x in locs) and len(set(locs)) == 100
    assert a.stats()["slot_classes"] == 1
    a.free(f, locs[10])
    assert a.allocate(f) == locs[10]  # the freed slot, not a new one


def test_footprint_is_exact_and_consistent():
    t = DRAMTier("d", 1 << 20, prefault=False)
    try:
        for n in (0, 1, 15, 16, 17, 255, 256, 4096, 65537, 1 << 20):
            assert t.footprint(n) == align_up(n) and t.footprint(n) % ALIGN == 0
            assert t.footprint(t.footprint(n)) == t.footprint(n)
    finally:
        t.close()


@pytest.mark.parametrize("nbytes", [0, 1, 100, 70_000, (16 << 20) + 5])
def test_odd_and_large_objects_round_trip(nbytes):
    t = DRAMTier("d", 40 << 20, prefault=False)
    try:
        val = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        assert t.write(["x"], [[val]]) == [True]
        out = torch.empty(nbytes, dtype=torch.uint8)
        assert t.read(["x"], [[out]]) == [True] and torch.equal(out, val)
        t.delete(["x"])
        assert t.used_bytes == 0 and t._alloc.free_bytes == 40 << 20
    finally:
        t.close()


def test_non_contiguous_caller_buffers_are_copied_correctly():
    t = DRAMTier("d", 1 << 20, prefault=False)
    try:
        base = torch.randint(0, 256, (64,), dtype=torch.uint8)
        strided = base[::2]  # 32 bytes, not contiguous
        assert t.write(["s"], [[strided]]) == [True]
        out = torch.zeros(64, dtype=torch.uint8)
        assert t.read(["s"], [[out[::2]]]) == [True]
        assert torch.equal(out[::2], strided) and not out[1::2].any()
    finally:
        t.close()


def test_a_class_carves_at_most_run_slots_at_a_time():
    """A class's free slots wait on its stack, whose allocation never shrinks: a carve stacks at most
    ``RUN_SLOTS`` of them, however small the slot and however large the slab."""
    from tierkv.tiers.slab_alloc import RUN_SLOTS

    a = SlabAllocator(1 << 30)
    first = a.allocate(64)
    assert first is not None
    assert a.stats()["free_slots"] == RUN_SLOTS - 1
    taken = [a.allocate(64) for _ in range(RUN_SLOTS - 1)]
    assert a.stats()["free_slots"] == 0 and len({first, *taken}) == RUN_SLOTS
    assert a.allocate(64) is not None and a.stats()["free_slots"] == RUN_SLOTS - 1  # the next run
    assert a.free_bytes == (1 << 30) - (RUN_SLOTS + 1) * 64
