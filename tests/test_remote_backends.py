"""The backend table: a backend is one class in ``BACKENDS``; the pool tier never names one.

A backend written here (an in-process dict behind the ``RemoteClient``
protocol) is registered under a new name and selected by config, and its codes
reach the tier only as ``Outcome`` values.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch
from tier_conformance import blob, key

from tierkv.errors import ConfigError
from tierkv.options import pop_int
from tierkv.tiers.remote import Outcome, RemoteClient
from tierkv.tiers.remote.backends import BACKENDS, backend_class, register_backend
from tierkv.tiers.remote.client import Backend, BackendSpec
from tierkv.tiers.remote.media import DramPoolTier, RemoteNPUTier
from tierkv.tiers.remote.mooncake import outcome_of as mooncake_outcome

FULL, GONE = -1, -2


class DictClient:
    """A pool of ``limit`` bytes in this process; codes: 0 ok, -1 full, -2 not found."""

    def __init__(self, limit: int) -> None:
        self.limit, self.objects = limit, {}

    def outcome(self, code: int) -> Outcome:
        return {FULL: Outcome.NO_SPACE, GONE: Outcome.NOT_FOUND}.get(code, Outcome.OK if code >= 0 else Outcome.ERROR)

    def accepts_device(self, device_type: str) -> bool:
        return device_type == "cpu"

    def register(self, ptr: int, nbytes: int) -> int:
        return 0

    def unregister(self, ptr: int) -> int:
        return 0

    def put(self, keys, ptrs, sizes, devices=None):
        out = []
        for k, pl, sl in zip(keys, ptrs, sizes):
            if k in self.objects:
                out.append(0)
            elif sum(len(v) for v in self.objects.values()) + sum(sl) > self.limit:
                out.append(FULL)
            else:
                self.objects[k] = b"".join(ctypes.string_at(p, n) for p, n in zip(pl, sl))
                out.append(0)
        return out

    def get(self, keys, ptrs, sizes, devices=None):
        out = []
        for k, pl, sl in zip(keys, ptrs, sizes):
            data = self.objects.get(k)
            if data is None or len(data) != sum(sl):
                out.append(GONE)
                continue
            off = 0
            for p, n in zip(pl, sl):
                ctypes.memmove(p, data[off:off + n], n)
                off += n
            out.append(len(data))
        return out

    def exists(self, keys):
        return [1 if k in self.objects else 0 for k in keys]

    def remove(self, keys):
        return [0 if self.objects.pop(k, None) is not None else GONE for k in keys]

    def put_sentinel(self, key: str) -> int:
        self.objects[key] = b"s"
        return 0

    def close(self) -> None:
        pass


class DictBackend(Backend):
    media = frozenset({"dram_pool"})
    made: list[DictClient] = []

    @classmethod
    def configure(cls, tier, medium, options, *, device="cpu"):
        limit = pop_int(options, "limit", 1 << 20, f"tier {tier!r}", min_value=1)

        def open_client() -> DictClient:
            c = DictClient(limit)
            cls.made.append(c)
            return c

        return BackendSpec(open_client=open_client, description="dict", default_capacity=limit)


@pytest.fixture
def dict_backend():
    register_backend("dict", DictBackend)
    DictBackend.made = []
    yield DictBackend
    BACKENDS.pop("dict", None)


def test_a_registered_backend_is_selected_by_name(dict_backend):
    tier = DramPoolTier.from_config("p", {"backend": "dict", "limit": 10_000, "probe_interval": 0.05})
    try:
        assert isinstance(dict_backend.made[0], RemoteClient)  # the protocol, structurally
        assert tier.capacity_bytes == 10_000 and tier.description == "dict"
        vals = [blob(i, 4000) for i in range(3)]
        # the third does not fit: the client answers -1, the tier sees NO_SPACE and refuses after one retry
        assert tier.write([key(i) for i in range(3)], [[v] for v in vals]) == [True, True, False]
        st = tier.extra_stats()
        assert st["refused"] == 1 and st["full_retries"] == 1 and st["available"]
        out = torch.zeros(4000, dtype=torch.uint8)
        assert tier.read([key(1)], [[out]]) == [True] and torch.equal(out, vals[1])
        tier.delete([key(1)])
        assert tier.contains([key(0), key(1)]) == [True, False]
    finally:
        tier.close()


def test_backend_options_are_the_backends_and_checked(dict_backend):
    with pytest.raises(ConfigError, match="option 'limit'"):
        DramPoolTier.from_config("p", {"backend": "dict", "limit": "10000"})
    with pytest.raises(ConfigError, match="unknown option"):
        DramPoolTier.from_config("p", {"backend": "dict", "master": "127.0.0.1:1"})


def test_unknown_and_unfit_backends_are_config_errors(dict_backend):
    with pytest.raises(ConfigError, match=r"unknown backend 'redis'; known: \['dict', 'memcache', 'mooncake'\]"):
        backend_class("redis", "p", "dram_pool")
    with pytest.raises(ConfigError, match="does not serve remote_npu"):
        RemoteNPUTier.from_config("r", {"backend": "dict"})
    with pytest.raises(TypeError):
        register_backend("bad", object)


@pytest.mark.parametrize("code, outcome", [
    (0, Outcome.OK), (4096, Outcome.OK), (-705, Outcome.EXISTS), (-704, Outcome.NOT_FOUND),
    (-200, Outcome.NO_SPACE), (-706, Outcome.BUSY), (-900, Outcome.UNAVAILABLE), (-901, Outcome.UNAVAILABLE),
    (-800, Outcome.PEER_UNREACHABLE), (-600, Outcome.ERROR), (-1, Outcome.ERROR),
])
def test_mooncake_codes_map_to_outcomes(code, outcome):
    assert mooncake_outcome(code) is outcome


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_raising_backend_call_costs_a_miss_and_releases_its_pins(dict_backend, monkeypatch, op):
    tier = DramPoolTier.from_config("p", {"backend": "dict", "probe_interval": 0.05})
    try:
        v = blob(1, 5000)
        assert tier.write([key(1)], [[v]]) == [True]
        client = dict_backend.made[-1]

        def boom(*a, **k):
            raise RuntimeError("injected backend fault")

        monkeypatch.setattr(client, op, boom)
        out = torch.zeros(5000, dtype=torch.uint8)
        if op == "put":
            assert tier.write([key(2)], [[blob(2, 5000)]]) == [False]
        else:
            assert tier.read([key(1)], [[out]]) == [False]
        assert "injected backend fault" in tier.extra_stats()["last_error"]
        regs = list(tier._session._regs.values())
        assert regs and all(r.pins == 0 for r in regs), [r.pins for r in regs]
        monkeypatch.undo()  # the backend heals: the probe brings the tier back
        end = time.monotonic() + 10
        while not tier.available and time.monotonic() < end:
            time.sleep(0.02)
        assert tier.read([key(1)], [[out]]) == [True] and torch.equal(out, v)
    finally:
        tier.close()


class _SlowGets:
    """Wraps a client's ``get``: waits ``delay`` seconds (past the tier's deadline), then writes as the real one
    would, and notes when it ended."""

    def __init__(self, client: DictClient, delay: float) -> None:
        self.real, self.delay, self.ended = client.get, delay, []
        client.get = self  # type: ignore[method-assign]

    def __call__(self, keys, ptrs, sizes, devices=None):
        time.sleep(self.delay)
        try:
            return self.real(keys, ptrs, sizes, devices)
        finally:
            self.ended.append(time.monotonic())


def test_a_read_past_its_deadline_into_the_callers_memory_returns_only_after_the_transfer_ended(dict_backend):
    # a deadline of 0.2 s; the transfer takes 0.6 s and then writes the object into the caller's buffer
    tier = DramPoolTier.from_config("p", {"backend": "dict", "timeout": 0.2, "probe_interval": 0.05})
    try:
        v = blob(1, 5000)
        assert tier.write([key(1)], [[v]]) == [True]
        slow = _SlowGets(dict_backend.made[-1], 0.6)
        out = torch.zeros(5000, dtype=torch.uint8)
        t0 = time.monotonic()
        assert tier.read([key(1)], [[out]]) == [False]  # past its deadline: a miss...
        answered = time.monotonic()
        assert slow.ended and slow.ended[0] <= answered  # ...answered once nothing can write into `out`
        assert answered - t0 >= 0.6
        st = tier.extra_stats()
        assert st["timeouts"] == 1 and st["late_reads_waited"] == 1 and st["late_reads_running"] == 0
    finally:
        tier.close()


def test_a_read_still_running_after_its_wait_is_counted_and_logged(dict_backend, caplog):
    tier = DramPoolTier.from_config("p", {"backend": "dict", "timeout": 0.1, "late_read_wait": 0.1,
                                          "probe_interval": 0.05})
    try:
        assert tier.write([key(1)], [[blob(1, 5000)]]) == [True]
        slow = _SlowGets(dict_backend.made[-1], 0.8)
        out = torch.zeros(5000, dtype=torch.uint8)
        with caplog.at_level("ERROR", logger="tierkv.tiers.remote"):
            assert tier.read([key(1)], [[out]]) == [False]
        assert not slow.ended  # (answered while the transfer still ran: the case the counter exposes)
        st = tier.extra_stats()
        assert st["late_reads_running"] == 1 and st["late_reads_waited"] == 0
        assert any("may write there after the miss" in r.getMessage() for r in caplog.records)
        end = time.monotonic() + 5
        while not slow.ended and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        tier.close()


def test_late_read_wait_is_checked(dict_backend):
    with pytest.raises(ConfigError, match="late_read_wait"):
        DramPoolTier.from_config("p", {"backend": "dict", "late_read_wait": 0})


def test_gets_through_the_store_register_their_trailers_once(dict_backend):
    # each chunk travels with a trailer: the trailers' memory is reused call after call, so the pool's
    # registrations do not grow with the number of gets
    from tierkv.store import TieredStore

    s = TieredStore.from_config({"tiers": [{"medium": "dram_pool", "backend": "dict", "limit": 1 << 20,
                                            "probe_interval": 0.05}]})
    try:
        keys = [key(i) for i in range(4)]
        assert s.put(keys, [blob(i, 1000) for i in range(4)]) == [True] * 4
        outs = [torch.zeros(1000, dtype=torch.uint8) for _ in keys]
        regs = []
        for _ in range(50):
            assert s.get(keys, outs) == [True] * 4
            regs.append(s.stats()["tiers"]["dram_pool"]["registered_bytes"])
        assert len(set(regs[1:])) == 1, regs  # (the first get registered the destinations and its trailers)
        assert all(torch.equal(o, blob(i, 1000)) for i, o in enumerate(outs))
    finally:
        s.close()


def test_cached_registrations_are_bounded_in_number(dict_backend, monkeypatch):
    import tierkv.tiers.remote.session as session_mod

    monkeypatch.setattr(session_mod, "REGISTER_COUNT_LIMIT", 16)
    tier = DramPoolTier.from_config("p", {"backend": "dict", "probe_interval": 0.05})
    try:
        s = tier._session
        keep = []
        for i in range(40):  # a caller handing a fresh small buffer to every call
            t = torch.zeros(64, dtype=torch.uint8)
            keep.append(t)
            reg = s.pin(t)
            s.unpin([reg])
        assert len(s._regs) <= 16 + 1  # (+ the tier's own permanent ones, if any)
        pinned = s.pin(keep[-1])
        for i in range(40):  # a pinned registration is never let go
            s.unpin([s.pin(torch.zeros(64, dtype=torch.uint8))])
        assert keep[-1].untyped_storage().data_ptr() in s._regs
        s.unpin([pinned])
    finally:
        tier.close()


def test_trailers_an_abandoned_call_may_still_touch_are_let_go(dict_backend):
    from tierkv.store import TieredStore

    s = TieredStore.from_config({"tiers": [{"medium": "dram_pool", "backend": "dict", "limit": 1 << 20,
                                            "timeout": 0.1, "late_read_wait": 0.05, "probe_interval": 0.05}]})
    try:
        keys = [key(i) for i in range(4)]
        assert s.put(keys, [blob(i, 1000) for i in range(4)]) == [True] * 4
        outs = [torch.zeros(1000, dtype=torch.uint8) for _ in keys]
        assert s.get(keys, outs) == [True] * 4
        arena = s.levels[0].integrity._arena  # (the pool level's Trailers strategy owns its trailer memory)
        assert arena._bufs  # this thread's trailer buffers, kept for the next call
        slow = _SlowGets(dict_backend.made[-1], 0.5)
        assert s.get(keys, outs) == [False] * 4  # abandoned at its deadline and its wait: still running
        assert not arena._bufs  # ...so its trailers are never handed to another call
        end = time.monotonic() + 10
        while not (slow.ended and s.levels[0].tier.available) and time.monotonic() < end:
            time.sleep(0.02)
        dict_backend.made[-1].get = slow.real
        assert s.get(keys, outs) == [True] * 4
        assert all(torch.equal(o, blob(i, 1000)) for i, o in enumerate(outs))
    finally:
        s.close()
