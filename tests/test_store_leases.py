"""``TieredStore.lease``: chunks held against eviction from a lookup to its load (invariant 9 of store.py).

A leased chunk is never evicted; a level whose chunks are all leased refuses new
chunks and never exceeds its capacity; a lease is released exactly once (by its
holder, by its deadline, counted, or by ``close``); what it cannot hold it names.
"""

from __future__ import annotations

import time

import pytest
import torch

from tierkv import Lease, StoreClosedError, TieredStore
from tierkv.outcome import PutOutcome

KB = 64 << 10


def _store(*tiers) -> TieredStore:
    return TieredStore.from_config({"tiers": list(tiers) or [{"medium": "dram", "capacity": "1MiB",
                                                              "eviction": "lru"}]})


def _val(i: int) -> torch.Tensor:
    return torch.full((KB,), i % 251, dtype=torch.uint8)


def _fill(store: TieredStore, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}{i}" for i in range(n)]
    store.put(keys, [_val(i) for i in range(n)])
    return keys


def _check_capacity(store: TieredStore) -> None:
    for t in store.stats()["tiers"].values():
        assert t["used_bytes"] <= t["capacity_bytes"]


def test_a_leased_chunk_is_never_evicted_and_eviction_takes_the_others():
    with _store() as s:
        old = _fill(s, "old", 8)
        lease = s.lease(old[:4], ttl_s=60)
        assert isinstance(lease, Lease) and lease.held == 4 and lease.unheld == []
        _fill(s, "new", 40)  # far more than the tier holds: everything unleased goes
        assert s.contains(old) == [True] * 4 + [False] * 4
        _check_capacity(s)
        outs = [torch.empty(KB, dtype=torch.uint8) for _ in range(4)]
        assert s.get(old[:4], outs) == [True] * 4
        assert all(torch.equal(o, _val(i)) for i, o in enumerate(outs))
        assert lease.release() is True and lease.release() is False  # once
        _fill(s, "more", 40)
        assert not any(s.contains(old))
        t = s.stats()["total"]
        assert (t["leases"], t["leased_chunks"], t["leases_released"], t["lease_expired"], t["leases_active"]) == \
            (1, 4, 1, 0, 0)


def test_a_level_all_leased_refuses_new_chunks_within_its_capacity():
    with _store() as s:
        keys = _fill(s, "k", 64)
        held = [k for k, c in zip(keys, s.contains(keys)) if c]
        with s.lease(held, ttl_s=60):
            out = s.put_detailed(["x0", "x1"], [_val(1), _val(2)])
            assert out == [PutOutcome.NO_ROOM] * 2
            assert s.stats()["dram"]["rejected"] >= 2
            _check_capacity(s)
            assert all(s.contains(held))
        # released (the with block): the same put now evicts and stores
        assert s.put_detailed(["x0"], [_val(1)]) == [PutOutcome.STORED]


def test_a_lease_past_its_deadline_is_counted_and_the_eviction_proceeds():
    with _store() as s:
        keys = _fill(s, "k", 64)
        held = [k for k, c in zip(keys, s.contains(keys)) if c]
        lease = s.lease(held, ttl_s=0.05)
        assert s.put_detailed(["x"], [_val(0)]) == [PutOutcome.NO_ROOM]  # held: refused
        deadline = time.monotonic() + 10
        while time.monotonic() < lease.deadline and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.put_detailed(["y"], [_val(0)]) == [PutOutcome.STORED]  # the deadline passed: it evicts
        assert lease.expired and lease.released
        assert lease.release() is False  # the holder's release after expiry changes nothing
        t = s.stats()["total"]
        assert t["lease_expired"] == 1 and t["leases_released"] == 0 and t["leases_active"] == 0
        _check_capacity(s)


def test_stats_count_an_expired_lease_without_any_put():
    with _store() as s:
        keys = _fill(s, "k", 2)
        lease = s.lease(keys, ttl_s=0.01)
        while time.monotonic() < lease.deadline:
            time.sleep(0.005)
        assert s.stats()["total"]["lease_expired"] == 1 and lease.expired


def test_a_lease_pins_the_fastest_tier_holding_each_key_and_names_what_it_cannot_hold():
    with _store({"medium": "hbm", "device": "cpu", "capacity": "512KiB", "eviction": "lru"},
                {"medium": "dram", "capacity": "4MiB", "eviction": "lru"}) as s:
        keys = _fill(s, "k", 12)  # the first ones demoted to dram, the last ones in hbm
        where = s.locate(keys)
        assert {"hbm", "dram"} <= set(where)
        with s.lease([*keys, "absent"], ttl_s=60) as lease:
            assert lease.held == 12 and lease.unheld == ["absent"]
            pins = {lvl.name: set(lvl.pinned) for lvl in s.levels}
            assert pins["hbm"] == {k for k, w in zip(keys, where) if w == "hbm"}
            assert pins["dram"] == {k for k, w in zip(keys, where) if w == "dram"}
        assert all(not lvl.pinned for lvl in s.levels)


def test_a_removed_leased_chunk_is_unreadable_and_freed_at_once_and_the_lease_says_so():
    with _store() as s:
        keys = _fill(s, "k", 4)
        used = s.stats()["dram"]["used_bytes"]
        lease = s.lease(keys, ttl_s=60)
        s.remove(keys[:2])
        assert s.contains(keys) == [False, False, True, True]
        assert s.stats()["dram"]["used_bytes"] == used // 2  # removal ends the lease's hold on them
        assert (lease.held, lease.unheld) == (2, keys[:2])
        s.remove(keys[2:])
        assert lease.released and lease.held == 0 and lease.release() is False  # it holds nothing any more
        assert s.stats()["dram"]["used_bytes"] == 0 and not s.levels[0].pinned
        assert s.stats()["total"]["leases_active"] == 0


def test_close_releases_every_lease():
    s = _store()
    keys = _fill(s, "k", 4)
    lease = s.lease(keys, ttl_s=60)
    s.close()
    assert lease.released and not lease.expired
    assert lease.release() is False
    assert not s.levels[0].pinned
    with pytest.raises(StoreClosedError):
        s.lease(keys, ttl_s=1)


def test_a_lease_of_nothing_holds_nothing_and_bad_arguments_are_named():
    with _store() as s:
        lease = s.lease(["nope"], ttl_s=1)
        assert lease.held == 0 and lease.released and lease.unheld == ["nope"]
        for bad in (0, -1, float("inf"), float("nan"), True, "5"):
            with pytest.raises(ValueError, match="ttl_s"):
                s.lease(["k"], ttl_s=bad)  # type: ignore[arg-type]
        with pytest.raises((TypeError, ValueError)):
            s.lease("k0", ttl_s=1)  # type: ignore[arg-type]


def test_a_chunk_evicted_after_its_lease_ran_out_is_missed_as_lease_expired():
    from tierkv.outcome import MissReason

    with _store() as s:
        keys = _fill(s, "k", 64)
        held = [k for k, c in zip(keys, s.contains(keys)) if c]
        late = s.lease(held[:4], ttl_s=0.02)  # runs out before its holder is done
        done = s.lease(held[4:8], ttl_s=0.02)  # runs out, then its holder lets go (its load is over)
        while time.monotonic() < max(late.deadline, done.deadline):
            time.sleep(0.005)
        assert s.stats()["total"]["lease_expired"] == 2
        done.release()
        _fill(s, "new", 64)  # everything else leaves
        assert not any(s.contains(held[:8]))
        assert s.why_missing(held[:4]) == [MissReason.LEASE_EXPIRED] * 4
        assert s.why_missing(held[4:8]) == [MissReason.EVICTED] * 4  # an ordinary eviction after the load
        assert s.why_missing(held[8:10]) == [MissReason.EVICTED] * 2
        assert s.stats()["total"]["misses_by_reason"]["lease_expired"] == 4


class _SlowRefusingSSD:
    """Builds an SSD tier whose writes stop at a gate (``entered`` set) and are then refused: a demotion into
    it is in flight for as long as the test holds the gate, and takes nothing."""

    @staticmethod
    def build(path, capacity: int):
        import threading

        from tierkv.tiers.ssd import SSDTier

        class SlowRefusing(SSDTier):
            def _write(self, keys, srcs):
                self.entered.set()
                assert self.gate.wait(10)
                return [False] * len(keys)

        tier = SlowRefusing("ssd", capacity, str(path))
        tier.entered, tier.gate = threading.Event(), threading.Event()
        return tier


def test_a_lease_granted_while_its_chunk_is_being_evicted_holds_it(tmp_path):
    import threading

    from tierkv import Level
    from tierkv.outcome import MissReason
    from tierkv.tiers.dram import DRAMTier

    # dram of 4 chunks (fifo) over a medium whose writes are slow, then refused
    ssd = _SlowRefusingSSD.build(tmp_path / "ssd", 64 * KB)
    s = TieredStore([Level(DRAMTier("dram", 4 * KB), eviction="fifo"), Level(ssd, persist="on_evict")],
                    promotion="never")
    try:
        keys = _fill(s, "k", 4)  # dram full
        got: dict[str, list] = {}
        put = threading.Thread(target=lambda: got.setdefault("put", s.put_detailed(["x"], [_val(9)])))
        put.start()
        assert ssd.entered.wait(10)  # the put chose k0 as its victim: its demotion is in flight
        lease = s.lease(["k0"], ttl_s=60)
        ssd.gate.set()  # the demotion ends, refused
        put.join(10)
        assert not put.is_alive()
        # the lease holds k0: readable until released (the put took room elsewhere)
        assert lease.held == 1 and lease.unheld == []
        out = torch.empty(KB, dtype=torch.uint8)
        assert s.get(["k0"], [out]) == [True] and torch.equal(out, _val(0))
        assert got["put"] == [PutOutcome.STORED]
        assert s.contains(keys) == [True, False, True, True]
        assert s.why_missing(["k1"]) == [MissReason.EVICTED]
        _check_capacity(s)
        assert lease.release() is True
        assert not s.levels[0].pinned
    finally:
        ssd.gate.set()
        s.close()


def test_leased_chunks_read_back_under_a_flood_of_puts():
    import random
    import threading

    # an hbm of 8 chunks over a dram of 16: puts from two threads evict and demote all the time, while two
    # others lease what they find and read it back before they let go
    s = _store({"medium": "hbm", "device": "cpu", "capacity": 8 * KB, "eviction": "fifo"},
               {"medium": "dram", "capacity": 16 * KB, "eviction": "fifo"})
    universe = [f"k{i}" for i in range(64)]
    misses: list[str] = []
    held_total = [0]
    errors: list[BaseException] = []
    done = threading.Event()

    def putter(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1000):
                batch = rng.sample(range(len(universe)), 3)
                s.put([universe[i] for i in batch], [_val(i) for i in batch])
        except BaseException as e:  # (reported by the test)
            errors.append(e)

    def leaser(seed: int) -> None:
        rng = random.Random(seed)
        outs = [torch.empty(KB, dtype=torch.uint8) for _ in range(8)]
        try:
            while not done.is_set():
                batch = rng.sample(range(len(universe)), 8)
                names = [universe[i] for i in batch]
                with s.lease(names, ttl_s=60) as lease:
                    held = [(k, i) for k, i in zip(names, batch) if k not in lease.unheld]
                    held_total[0] += len(held)
                    for _ in range(2):  # (read twice: the puts go on between the reads)
                        oks = s.get([k for k, _ in held], outs[:len(held)])
                        for (k, i), ok, o in zip(held, oks, outs):
                            if not ok or not torch.equal(o, _val(i)):
                                misses.append(k)
        except BaseException as e:  # (reported by the test)
            errors.append(e)

    with s:
        put_threads = [threading.Thread(target=putter, args=(n,)) for n in range(2)]
        lease_threads = [threading.Thread(target=leaser, args=(10 + n,)) for n in range(2)]
        for t in put_threads + lease_threads:
            t.start()
        for t in put_threads:
            t.join(120)
        done.set()
        for t in lease_threads:
            t.join(120)
        assert not errors
        assert misses == []
        assert held_total[0] > 0
        _check_capacity(s)
        # a promotion the last reads queued pins its source until it lands: wait for the background copies
        assert s.drain_write_behind(60)
        assert all(not lvl.pinned for lvl in s.levels)
        assert s.stats()["total"]["leases_active"] == 0


def test_remove_of_a_leased_key_ends_the_hold_and_a_new_put_of_it_is_stored():
    with _store() as s:
        keys = _fill(s, "k", 4)  # a tier of 16 chunks, nearly empty
        lease = s.lease(keys, ttl_s=60)
        s.remove(keys[:1])
        assert lease.unheld == keys[:1] and lease.held == 3  # the lease says it no longer holds k0
        assert s.put_detailed(keys[:1], [_val(7)]) == [PutOutcome.STORED]
        out = torch.empty(KB, dtype=torch.uint8)
        assert s.get(keys[:1], [out]) == [True] and torch.equal(out, _val(7))
        assert lease.release() is True
        assert not s.levels[0].pinned and s.contains(keys) == [True] * 4
        _check_capacity(s)
