"""Removal listeners (``TieredStore.add_removal_listener``) hear each departure once, and only departures.

A key is heard when it leaves the store: its last copy in a managed tier evicted with none taken below, or
``remove``d while some tier (a shared pool included) held it.  A key never stored, removed again, named twice
in one call, or removed while its eviction was in flight is heard once or not at all, as it left.
"""

from __future__ import annotations

import threading

import torch
from fake_media import FakeTier

from tierkv import Level, TieredStore
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.ssd import SSDTier

KB = 64 << 10


def _val(i: int) -> torch.Tensor:
    return torch.full((KB,), i % 251, dtype=torch.uint8)


def _put(store: TieredStore, keys: list[str]) -> None:
    assert store.put(keys, [_val(i) for i in range(len(keys))]) == [True] * len(keys)


def test_remove_is_heard_only_for_keys_that_were_there_once_each():
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 16 * KB}]}) as s:
        heard: list[str] = []
        s.add_removal_listener(heard.extend)
        _put(s, ["a", "b"])
        s.remove(["never"])
        assert heard == []
        s.remove(["a", "never", "a"])  # (named twice: it left once)
        assert heard == ["a"]
        s.remove(["a"])  # gone already
        s.remove(["a", "b"])
        assert heard == ["a", "b"]


def test_an_evicted_key_is_heard_once_and_not_again_at_its_removal():
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 2 * KB, "eviction": "fifo"}]}) as s:
        heard: list[str] = []
        s.add_removal_listener(heard.extend)
        _put(s, ["a", "b"])
        _put(s, ["c"])  # evicts a, its only copy
        assert heard == ["a"]
        s.remove(["a"])
        assert heard == ["a"]


def test_a_key_removed_while_its_demotion_is_in_flight_is_heard_once(tmp_path):
    class SlowSSD(SSDTier):
        def _write(self, keys, srcs):
            entered.set()
            assert gate.wait(10)
            return super()._write(keys, srcs)

    entered, gate = threading.Event(), threading.Event()
    ssd = SlowSSD("ssd", 64 * KB, str(tmp_path / "ssd"))
    s = TieredStore([Level(DRAMTier("dram", 4 * KB), eviction="fifo"), Level(ssd, persist="on_evict")],
                    promotion="never")
    heard: list[str] = []
    s.add_removal_listener(heard.extend)
    try:
        _put(s, ["k0", "k1", "k2", "k3"])
        put = threading.Thread(target=_put, args=(s, ["x"]))
        put.start()
        assert entered.wait(10)  # k0's demotion is in flight
        s.remove(["k0"])
        assert heard == ["k0"]
        gate.set()
        put.join(10)
        assert not put.is_alive()
        assert heard == ["k0"] and s.contains(["k0"]) == [False]  # (its copy below was withdrawn)
    finally:
        gate.set()
        s.close()


def test_a_key_removed_from_a_shared_pool_is_heard_when_the_pool_held_it():
    pool = FakeTier("pool", 1 << 20, managed=False)
    with TieredStore([Level(pool)]) as s:
        heard: list[str] = []
        s.add_removal_listener(heard.extend)
        _put(s, ["p"])
        s.remove(["p", "never"])
        assert heard == ["p"]
        s.remove(["p"])
        assert heard == ["p"]
