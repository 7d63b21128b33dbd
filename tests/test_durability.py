"""The durability contract: ``flush()`` says which acknowledged chunks are not durable, and why; what
``remove`` removed stays removed, in every tier, across restarts.

A write-behind copy the store gives up (the queue full, a persistent tier that refuses the chunk or fails
the write) makes the next ``flush()`` false, with a count per reason and the keys; ``stats()``, the
Prometheus exporter and one log line say so too.  A ``remove`` that races a copy in flight withdraws it.
"""

from __future__ import annotations

import errno
import logging
import os
import textwrap
import threading

import pytest
from fake_media import FakeTier
from test_persistence import CHUNK, chain, chunk, keys_for, run_killed_child, ssd_only

from tierkv import Level, TieredStore
from tierkv.durability import DropReason, FlushResult
from tierkv.tiers.dram import DRAMTier


def fast_over(slow: FakeTier, chunks: int = 64, queue: int = 65536) -> TieredStore:
    return TieredStore([Level(DRAMTier("fast", chunks * CHUNK, prefault=False)), Level(slow)],
                       promotion="never", write_behind_queue=queue)


# -- flush() tells ----------------------------------------------------------------------------------------

def test_flush_is_true_when_everything_is_durable(tmp_path):
    keys = keys_for(20)
    with TieredStore.from_config(chain(tmp_path / "ssd")) as store:
        store.put(keys, [chunk(i) for i in range(20)])
        res = store.flush()
        assert isinstance(res, FlushResult) and res and res.durable
        assert (res.not_durable, res.reasons, res.keys, res.pending) == (0, {}, (), 0)
        assert store.stats()["total"]["write_behind_dropped"] == 0


def test_flush_reports_chunks_too_large_for_the_ssd_tier(tmp_path, caplog):
    # an ssd tier smaller than one chunk: it can take none of them, and the put still answers True
    cfg = chain(tmp_path / "ssd")
    cfg["tiers"][1]["capacity"] = CHUNK // 2
    keys = keys_for(6)
    with TieredStore.from_config(cfg) as store:
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            assert store.put(keys, [chunk(i) for i in range(6)]) == [True] * 6
            res = store.flush()
        assert not res
        assert res.not_durable == 6 and res.reasons == {"too_large": 6} and set(res.keys) == set(keys)
        total = store.stats()["total"]
        assert total["write_behind_dropped"] == 6
        assert total["write_behind_dropped_by_reason"]["too_large"] == 6
        assert "acknowledged chunks was given up (1 too_large)" in caplog.text  # (then one line per 10 s)
        assert "not durable" in str(res)
        again = store.flush()
        assert set(again.keys) == set(keys), "still held only in dram: not durable, named again"
        assert store.stats()["total"]["write_behind_dropped"] == 6  # the lifetime counter counts each once


def test_flush_reports_a_full_queue():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)  # writes wait at the gate: the queue fills
    slow.gate.clear()
    store = fast_over(slow, queue=4)
    try:
        keys = keys_for(20)
        for i, k in enumerate(keys):
            assert store.put([k], [chunk(i)]) == [True]
        dropped = store.stats()["total"]["write_behind_dropped_by_reason"]["queue_full"]
        assert dropped > 0
        slow.gate.set()
        res = store.flush()  # (it queues the given-up copies again: those the queue takes land)
        assert not res and 0 < res.not_durable <= dropped and res.reasons == {"queue_full": res.not_durable}
        assert set(res.keys) == set(keys) - set(slow.data)  # exactly the ones that did not land
    finally:
        slow.gate.set()
        store.close()


def test_flush_names_exactly_the_chunks_not_on_disk_now(tmp_path):
    # dram of 16 chunks over an ssd, no write-behind queue: each put's copy is given up (queue_full), yet the
    # 24 chunks dram evicts are demoted onto the ssd: flush names the 16 that are only in dram, nothing more
    cfg = chain(tmp_path / "ssd", dram_chunks=16)
    cfg["write_behind_queue"] = 0
    keys = keys_for(40)
    with TieredStore.from_config(cfg) as store:
        ssd = store.levels[1].tier
        for i, k in enumerate(keys):
            assert store.put([k], [chunk(i)]) == [True]
        res = store.flush()
        on_disk = {k for k, there in zip(keys, ssd.contains(keys)) if there}
        assert len(on_disk) == 24
        assert not res and set(res.keys) == set(keys) - on_disk
        assert res.not_durable == 16 and res.reasons == {"queue_full": 16}
        total = store.stats()["total"]
        assert total["write_behind_not_durable"] == 16  # now, what health follows
        assert total["write_behind_dropped"] == 40  # over the store's life
        # remove 2 of them, put 8 more: the 6 dram evicts go down to the ssd, the 8 new ones stay in dram
        removed = [k for k in keys if k not in on_disk][:2]
        store.remove(removed)
        more = keys_for(8, "more")
        assert store.put(more, [chunk(40 + i) for i in range(8)]) == [True] * 8
        res = store.flush()
        everything = keys + more
        on_disk = {k for k, there in zip(everything, ssd.contains(everything)) if there}
        assert len(on_disk) == 30
        assert set(res.keys) == set(everything) - on_disk - set(removed) and res.not_durable == 16
        assert store.stats()["total"]["write_behind_not_durable"] == 16
        assert store.flush().keys == res.keys, "still not durable: named again"
        store.remove(list(res.keys))
        assert store.flush(), "nothing acknowledged is left undurable"
        assert store.stats()["total"]["write_behind_not_durable"] == 0
        assert store.stats()["total"]["write_behind_dropped"] == 48


def test_flush_reports_an_injected_write_fault():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)
    slow.fail_writes = True
    store = fast_over(slow)
    try:
        keys = keys_for(5)
        assert store.put(keys, [chunk(i) for i in range(5)]) == [True] * 5
        res = store.flush()
        assert not res and res.not_durable == 5 and res.reasons == {"write_failed": 5}
        slow.fail_writes = False
        store.put(["later"], [chunk(9)])
        assert store.flush()
    finally:
        store.close()


def test_flush_reports_an_unavailable_tier():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)
    slow.up = False
    store = fast_over(slow)
    try:
        store.put(keys_for(3), [chunk(i) for i in range(3)])
        res = store.flush()
        assert not res and res.reasons == {"unavailable": 3}
    finally:
        store.close()


def test_flush_reports_a_full_disk(tmp_path, monkeypatch):
    # the ssd tier's device answers ENOSPC to every write: a real tier, a refused write, a reason
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    keys = keys_for(4)
    with TieredStore.from_config(chain(tmp_path / "ssd")) as store:
        monkeypatch.setattr(os, "pwritev", full)
        monkeypatch.setattr(os, "pwrite", full)
        assert store.put(keys, [chunk(i) for i in range(4)]) == [True] * 4
        res = store.flush()
        monkeypatch.undo()
        assert not res and res.not_durable == 4 and res.reasons == {"disk_full": 4}, res
        assert store.stats()["total"]["write_behind_dropped_by_reason"]["disk_full"] == 4


def test_admission_refusal_is_no_loss(tmp_path):
    cfg = chain(tmp_path / "ssd")
    cfg["tiers"][1]["admission"] = {"policy": "size", "max_bytes": CHUNK - 1}
    with TieredStore.from_config(cfg) as store:
        store.put(keys_for(5), [chunk(i) for i in range(5)])
        assert store.flush(), "a tier that does not admit a chunk owes it nothing"


def test_the_exporter_counts_drops_by_reason():
    from tierkv.metrics import Exporter

    slow = FakeTier("slow", 64 * CHUNK, persistent=True)
    slow.fail_writes = True
    store = fast_over(slow)
    try:
        store.put(keys_for(3), [chunk(i) for i in range(3)])
        store.flush()
        text = Exporter(store).text()
        assert 'tierkv_write_behind_dropped_total{reason="write_failed"} 3.0' in text
        assert 'tierkv_write_behind_dropped_total{reason="queue_full"} 0.0' in text
    finally:
        store.close()


def test_drops_are_counted_by_reason_in_the_enum():
    assert {r.value for r in DropReason} >= {"queue_full", "too_large", "no_room", "disk_full", "write_failed"}


# -- what remove removed stays removed --------------------------------------------------------------------

def test_put_then_remove_loop_finds_none_back_after_reopen(tmp_path):
    keys = keys_for(2000, "r")
    with TieredStore.from_config(chain(tmp_path / "ssd", ssd_chunks=4096)) as store:
        for i, k in enumerate(keys):
            store.put([k], [chunk(i % 7)])
            store.remove([k])
        assert not any(store.contains(keys))
        assert store.flush()
        assert store.stats()["ssd"]["entries"] == 0
    with TieredStore.from_config(ssd_only(tmp_path / "ssd", 4096)) as store:
        assert not any(store.contains(keys)), "a removed key came back after the reopen"


def test_remove_withdraws_a_write_behind_copy_in_flight():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)
    slow.gate.clear()  # the copy's write waits here, its reservation held below
    store = fast_over(slow)
    try:
        store.put(["k"], [chunk(1)])
        assert slow.entered.wait(10), "the write-behind copy never started"
        store.remove(["k"])  # while the copy is in flight
        slow.gate.set()
        assert store.flush()
        assert store.contains(["k"]) == [False]
        assert "k" not in slow.data, "the withdrawn copy's bytes stay on the medium"
        assert store.stats()["slow"]["entries"] == 0 and store.stats()["slow"]["used_bytes"] == 0
    finally:
        slow.gate.set()
        store.close()


def test_remove_withdraws_a_demotion_in_flight():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)
    slow.gate.clear()
    store = TieredStore([Level(DRAMTier("fast", 1 * CHUNK, prefault=False)), Level(slow, persist="on_evict")],
                        promotion="never")
    try:
        store.put(["old"], [chunk(1)])
        t = threading.Thread(target=store.put, args=(["new"], [chunk(2)]))
        t.start()  # "old" is evicted: its demotion waits at the gate
        assert slow.entered.wait(10), "the demotion never started"
        store.remove(["old"])
        slow.gate.set()
        t.join(10)
        assert store.contains(["old", "new"]) == [False, True]
        assert "old" not in slow.data
    finally:
        slow.gate.set()
        store.close()


def test_flush_reports_a_write_through_copy_that_failed():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)
    slow.fail_writes = True
    store = TieredStore([Level(DRAMTier("fast", 64 * CHUNK, prefault=False)), Level(slow, persist="write_through")],
                        promotion="never")
    try:
        assert store.put(keys_for(3), [chunk(i) for i in range(3)]) == [True] * 3  # stored in the fast tier
        res = store.flush()
        assert not res and res.reasons == {"write_failed": 3}, "the persistent copies are missing: say so"
    finally:
        store.close()


def test_flush_that_times_out_says_how_many_are_still_queued():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)
    slow.gate.clear()  # the device is stuck: nothing lands before the timeout
    store = fast_over(slow)
    try:
        store.put(keys_for(4), [chunk(i) for i in range(4)])
        res = store.flush(timeout=0.2)
        assert not res and res.timed_out and res.pending > 0 and res.not_durable == 0
        slow.gate.set()
        assert store.flush()  # they landed after all
    finally:
        slow.gate.set()
        store.close()


REMOVE_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {testdir!r})
    from tierkv import TieredStore
    from test_persistence import chain, chunk, keys_for
    store = TieredStore.from_config(chain({path!r}, ssd_chunks=4096))
    keys = keys_for(2000, "r")
    for i, k in enumerate(keys):
        store.put([k], [chunk(i % 7)])
        store.remove([k])
    res = store.flush()
    print("flushed", bool(res), flush=True)
    os.kill(os.getpid(), 9)
""")


@pytest.mark.slow
def test_put_then_remove_loop_finds_none_back_after_a_kill(tmp_path):
    p = run_killed_child(REMOVE_CHILD, tmp_path / "ssd", timeout=300)
    assert "flushed True" in p.stdout
    keys = keys_for(2000, "r")
    with TieredStore.from_config(ssd_only(tmp_path / "ssd", 4096)) as store:
        assert not any(store.contains(keys)), "a removed key came back after a kill"


def test_flush_reports_chunks_the_ssd_tier_lost_with_its_regions_removed_behind_it(tmp_path):
    """A tmp cleaner removes the sealed region files of a live tier: the chunks in them were acknowledged
    and flushed, and are gone.  The next ``flush()`` is false and counts them under ``lost`` (the medium
    names no keys), as ``stats()`` does; a flush after that, with nothing new lost, is true again."""
    import shutil

    cfg = {"tiers": [{"medium": "ssd", "path": str(tmp_path / "s"), "capacity": 256 * (CHUNK + 8192),
                      "region_size": "1MiB"}]}
    keys = keys_for(150)
    with TieredStore.from_config(cfg) as store:
        assert all(store.put(keys, [chunk(i) for i in range(150)]))
        assert store.flush()
        shutil.rmtree(tmp_path / "s" / "regions")  # the sealed regions' chunks go with it
        res = store.flush()
        lost = store.levels[0].tier.extra_stats()["objects_lost"]
        assert lost > 0
        assert not res and res.reasons.get(DropReason.LOST.value) == lost and res.not_durable >= lost
        assert store.stats()["total"]["write_behind_dropped_by_reason"][DropReason.LOST.value] == lost
        assert store.flush(), "a loss is reported by one flush only"
