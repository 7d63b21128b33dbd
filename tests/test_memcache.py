"""The ``memcache`` backend of ``dram_pool`` against a fake of ``memcache_hybrid``.

MemFabric memcache runs only on Ascend; this fake implements the documented API
(``DistributedObjectStore``: ``init``, ``register_buffer``, ``batch_is_exist``,
``batch_put_from_layers``, ``batch_get_into_layers``, ``batch_remove``) over
process memory, and checks what the real one requires: registered memory only,
keys shorter than 256 bytes, one copy direction per call.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import types

import pytest
import torch
from tier_conformance import TierConformance, blob, key

from tierkv.errors import ConfigError
from tierkv.tiers.remote.media import DramPoolTier


class FakeMemcacheStore:
    """An in-process stand-in for ``memcache_hybrid.DistributedObjectStore``."""

    objects: dict[str, bytes] = {}  # shared by every instance: one "pool" per test
    capacity = 1 << 30
    init_code = 0
    hang = threading.Event()  # while set, every data call blocks
    directions: list[tuple[str, int]] = []

    def __init__(self) -> None:
        self.regions: list[tuple[int, int]] = []
        self.closed = False
        self.initialised = False

    def init(self, local_rank, init_bm=True):
        assert init_bm is True and isinstance(local_rank, int)
        self.initialised = self.init_code == 0
        return self.init_code

    def _usable(self) -> None:
        assert self.initialised and not self.closed, "memcache used before init or after close"
        while self.hang.is_set():
            time.sleep(0.01)

    def register_buffer(self, ptr, size):
        self.regions.append((ptr, size))
        return 0

    def unregister_buffer(self, ptr):
        self.regions = [r for r in self.regions if r[0] != ptr]
        return 0

    def _registered(self, ptr, n) -> bool:
        return any(b <= ptr and ptr + n <= b + s for b, s in self.regions)

    def batch_is_exist(self, keys):
        self._usable()
        return [1 if k in self.objects else 0 for k in keys]

    def batch_put_from_layers(self, keys, ptrs, sizes, direction):
        self._usable()
        self.directions.append(("put", direction))
        out = []
        for k, pl, sl in zip(keys, ptrs, sizes):
            if len(k.encode()) >= 256 or len(pl) != len(sl):
                out.append(-3000)
            elif k in self.objects:
                out.append(-3003)  # exists: an error for memcache
            elif not all(self._registered(p, n) for p, n in zip(pl, sl)):
                out.append(-3101)
            elif sum(len(v) for v in self.objects.values()) + sum(sl) > self.capacity:
                out.append(-3105)
            else:
                self.objects[k] = b"".join(ctypes.string_at(p, n) for p, n in zip(pl, sl))
                out.append(0)
        return out

    def batch_get_into_layers(self, keys, ptrs, sizes, direction):
        self._usable()
        self.directions.append(("get", direction))
        out = []
        for k, pl, sl in zip(keys, ptrs, sizes):
            data = self.objects.get(k)
            if data is None:
                out.append(-3004)
            elif sum(sl) != len(data) or not all(self._registered(p, n) for p, n in zip(pl, sl)):
                out.append(-3000)
            else:
                off = 0
                for p, n in zip(pl, sl):
                    ctypes.memmove(p, data[off:off + n], n)
                    off += n
                out.append(0)
        return out

    def batch_remove(self, keys):
        self._usable()
        return [0 if self.objects.pop(k, None) is not None else -3004 for k in keys]

    def close(self):
        assert not self.closed, "close() called twice"
        self.closed = True


@pytest.fixture
def fake_memcache(monkeypatch):
    mod = types.ModuleType("memcache_hybrid")
    mod.DistributedObjectStore = FakeMemcacheStore
    FakeMemcacheStore.objects = {}
    FakeMemcacheStore.capacity = 1 << 30
    FakeMemcacheStore.init_code = 0
    FakeMemcacheStore.hang.clear()
    FakeMemcacheStore.directions = []
    monkeypatch.setitem(sys.modules, "memcache_hybrid", mod)
    yield FakeMemcacheStore
    FakeMemcacheStore.hang.clear()


@pytest.fixture
def make_memcache(fake_memcache):
    made = []

    def make(**opts):
        o = {"backend": "memcache", "capacity": "64MiB", "probe_interval": 0.05}
        o.update(opts)
        t = DramPoolTier.from_config("mc", o)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


class TestMemcacheConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, make_memcache):
        return lambda cap: make_memcache(capacity=cap)


def test_not_imported_unless_selected_and_clear_error_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)  # import fails
    with pytest.raises(ConfigError, match="memcache_hybrid"):
        DramPoolTier.from_config("mc", {"backend": "memcache", "capacity": "1GiB"})


def test_mooncake_options_are_refused(fake_memcache):
    with pytest.raises(ConfigError, match="Mooncake option"):
        DramPoolTier.from_config("mc", {"backend": "memcache", "capacity": "1GiB", "master": "h:1"})
    with pytest.raises(ConfigError, match="capacity"):
        DramPoolTier.from_config("mc", {"backend": "memcache"})


def test_layers_and_host_copy_directions(make_memcache, fake_memcache):
    t = make_memcache()
    layers = [blob(i, 1000 + i) for i in range(5)]
    assert t.write([key(1)], [layers]) == [True]
    stored = fake_memcache.objects["tierkv/dram_pool/" + key(1)]
    assert stored == torch.cat(layers).numpy().tobytes()
    out = [torch.zeros(2505, dtype=torch.uint8), torch.zeros(2505, dtype=torch.uint8)]
    assert t.read([key(1)], [out]) == [True]
    assert torch.equal(torch.cat(out), torch.cat(layers))
    # host memory: 3 = host→global, 2 = global→host
    assert ("put", 3) in fake_memcache.directions and ("get", 2) in fake_memcache.directions


def test_existing_key_counts_as_stored(make_memcache, fake_memcache):
    a, b = make_memcache(), make_memcache()
    v = blob(1, 100)
    assert a.write([key(1)], [[v]]) == [True]
    assert b.write([key(1)], [[blob(2, 100)]]) == [True]  # dedup, first content kept
    out = torch.zeros(100, dtype=torch.uint8)
    assert b.read([key(1)], [[out]]) == [True] and torch.equal(out, v)


def test_keys_must_fit_memcache(make_memcache):
    t = make_memcache()
    with pytest.raises(ValueError, match="too long"):
        t.write(["x" * 250], [[blob(1, 10)]])
    assert t.write(["x" * 200], [[blob(1, 10)]]) == [True]


def test_full_pool_refuses_and_counts(make_memcache, fake_memcache):
    fake_memcache.capacity = 10_000
    t = make_memcache()
    ok = t.write([key(i) for i in range(4)], [[blob(i, 4000)] for i in range(4)])
    assert ok == [True, True, False, False]
    st = t.extra_stats()
    assert st["refused"] == 2 and st["available"] is True


def test_init_failure_leaves_it_unavailable_until_init_succeeds(make_memcache, fake_memcache):
    fake_memcache.init_code = -3001
    t = make_memcache(connect_wait=0.2)
    assert not t.available
    assert t.write([key(1)], [[blob(1, 10)]]) == [False]
    assert "init" in t.extra_stats()["last_error"]
    fake_memcache.init_code = 0
    end = time.monotonic() + 10
    while not t.available and time.monotonic() < end:
        time.sleep(0.02)
    assert t.available
    assert t.write([key(1)], [[blob(1, 10)]]) == [True]


def test_hanging_backend_costs_one_deadline_then_misses(make_memcache, fake_memcache):
    # a read into the caller's memory is waited out past its deadline, at most late_read_wait more
    t = make_memcache(timeout=0.2, late_read_wait=0.3)
    v = blob(1, 100)
    assert t.write([key(1)], [[v]]) == [True]
    fake_memcache.hang.set()
    out = torch.zeros(100, dtype=torch.uint8)
    t0 = time.monotonic()
    assert t.read([key(1)], [[out]]) == [False]
    assert 0.5 <= time.monotonic() - t0 < 2.0  # deadline + late_read_wait; blocking takes 4.5 s+
    st = t.extra_stats()
    assert not t.available and st["timeouts"] == 1 and st["late_reads_running"] == 1
    t0 = time.monotonic()
    assert t.contains([key(1)]) == [False]
    assert time.monotonic() - t0 < 0.2
    fake_memcache.hang.clear()
    end = time.monotonic() + 10
    while not t.available and time.monotonic() < end:
        time.sleep(0.02)
    assert t.available
    assert t.read([key(1)], [[out]]) == [True] and torch.equal(out, v)


def test_restarted_pool_is_not_claimed(make_memcache, fake_memcache):
    t = make_memcache(presence_ttl=60)
    assert t.write([key(1)], [[blob(1, 10)]]) == [True]
    assert t.contains([key(1)]) == [True]
    fake_memcache.objects.clear()  # the pool lost everything, sentinel included
    assert t.contains([key(1)]) == [False]
    assert t.extra_stats()["pool_lost"] == 1


def test_parts_the_backend_cannot_reach_go_through_staging(make_memcache, fake_memcache, monkeypatch):
    from tierkv.tiers.remote import memcache

    # a backend that reaches no caller memory directly: every part is staged through the tier's own buffer
    monkeypatch.setattr(memcache.MemcacheClient, "accepts_device", lambda self, device_type: False)
    t = make_memcache()
    layers = [blob(i, 3000 + i) for i in range(3)]
    assert t.write([key(1), key(2)], [layers, [blob(9, 777)]]) == [True, True]
    outs = [torch.zeros(4500, dtype=torch.uint8), torch.zeros(4503, dtype=torch.uint8)]
    other = torch.zeros(777, dtype=torch.uint8)
    assert t.read([key(1), key(2)], [outs, [other]]) == [True, True]
    assert torch.equal(torch.cat(outs), torch.cat(layers)) and torch.equal(other, blob(9, 777))
    regs = t._session._regs.values()
    caller = {p.untyped_storage().data_ptr() for p in layers + outs + [other]}
    assert not caller & {r.ptr for r in regs}, "a caller buffer was registered"
