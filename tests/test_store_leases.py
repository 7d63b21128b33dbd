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


def test_a_removed_leased_chunk_is_unreadable_at_once_and_freed_at_release():
    with _store() as s:
        keys = _fill(s, "k", 4)
        used = s.stats()["dram"]["used_bytes"]
        lease = s.lease(keys, ttl_s=60)
        s.remove(keys[:2])
        assert s.contains(keys) == [False, False, True, True]
        assert s.stats()["dram"]["used_bytes"] == used  # still held
        lease.release()
        assert s.stats()["dram"]["used_bytes"] < used


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
