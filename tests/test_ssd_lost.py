"""Chunks the ssd tier lost are counted as the chunks a user stored, whatever the cause, and no damaged
object reads as present.

* a region file emptied or removed while the store was closed, a record found damaged, a trim at reopen:
  ``objects_lost`` in the tier's stats, ``lost`` in the first ``flush()`` after the reopen, the metrics;
* a large object (pieces and a manifest, ``tiers/ssd/large.py``) counts once in ``objects``, ``objects_lost``,
  ``lost`` and ``trimmed``, never by piece, and ``objects`` never goes below zero;
* ``tierkv inspect --verify`` names a damaged large object by the key its user stored and exits 1;
  ``--repair`` removes it whole, so no object reads as present and misses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tierkv import TieredStore
from tierkv.durability import DropReason
from tierkv.metrics import register
from tierkv.tiers.ssd import SSDTier, inspect_dir

MiB = 1 << 20
CHUNK = 16 << 10
LOST = DropReason.LOST.value
BIN = Path(sys.executable).parent


def tierkv(*args) -> subprocess.CompletedProcess:
    """The command as an operator runs it."""
    r = subprocess.run([str(BIN / "tierkv"), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def val(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def ssd_only(path, capacity="64MiB") -> dict:
    return {"tiers": [{"medium": "ssd", "path": str(path), "capacity": capacity, "region_size": "1MiB"}]}


def medium_metric(store, field: str) -> float:
    exp = register(store, CollectorRegistry())
    try:
        for fam in text_string_to_metric_families(exp.text()):
            for s in fam.samples:
                if s.name == "tierkv_tier_medium" and s.labels.get("field") == field:
                    return s.value
    finally:
        exp.stop()
    raise AssertionError(f"no tierkv_tier_medium sample for {field}")


def flip_byte_of(path: str, v: torch.Tensor, at: int) -> None:
    """Flip one byte of the stored bytes ``v[at:]`` in whichever region file holds them."""
    needle = v[at:at + 64].numpy().tobytes()
    for name in sorted(os.listdir(os.path.join(path, "regions"))):
        f = os.path.join(path, "regions", name)
        with open(f, "rb") as fh:
            data = bytearray(fh.read())
        pos = data.find(needle)
        if pos >= 0:
            data[pos + 10] ^= 0xFF
            with open(f, "wb") as fh:
                fh.write(data)
            return
    raise AssertionError("the object's bytes were not found")


# -- finding: a lost region's chunks go uncounted ----------------------------------------------------
@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_region_file_emptied_or_removed_while_closed_counts_its_chunks_lost(tmp_path, how):
    # 100 chunks of 16 KiB in regions of 1 MiB: several region files; the oldest is emptied (or removed)
    path = tmp_path / "s"
    keys = [f"k{i}" for i in range(100)]
    with TieredStore.from_config(ssd_only(path)) as store:
        assert all(store.put(keys, [val(i, CHUNK) for i in range(100)]))
    oldest = os.path.join(path, "regions", sorted(os.listdir(path / "regions"))[0])
    if how == "truncated":
        os.truncate(oldest, 0)
    else:
        os.unlink(oldest)
    with TieredStore.from_config(ssd_only(path)) as store:
        gone = store.contains(keys).count(False)
        assert 0 < gone < 100
        tier = store.levels[0].tier.extra_stats()
        assert tier["objects"] == 100 - gone
        assert tier["objects_lost"] == gone  # (and not only ``partial_files_removed``)
        assert medium_metric(store, "objects_lost") == gone
        res = store.flush()  # the first flush after the reopen says so
        assert not res and res.reasons.get(LOST) == gone
        assert store.stats()["total"]["write_behind_dropped_by_reason"][LOST] == gone
        assert store.flush(), "a loss is reported by one flush only"


def test_a_corrupt_record_found_by_a_read_is_a_lost_chunk(tmp_path):
    path = tmp_path / "s"
    with TieredStore.from_config(ssd_only(path)) as store:
        assert all(store.put(["a", "b"], [val(1, CHUNK), val(2, CHUNK)]))
    flip_byte_of(str(path), val(1, CHUNK), 4096)
    with TieredStore.from_config(ssd_only(path)) as store:
        assert store.get(["a", "b"], [torch.empty(CHUNK, dtype=torch.uint8) for _ in range(2)]) == [False, True]
        tier = store.levels[0].tier.extra_stats()
        assert tier["corrupt"] == tier["objects_lost"] == 1
        res = store.flush()
        assert not res and res.reasons.get(LOST) == 1


# -- finding: large objects counted by piece ------------------------------------------------------------
def test_large_objects_lost_with_their_directory_count_once_each(tmp_path):
    # 3 chunks of 3 MiB (pieces in several regions of 1 MiB), flushed; the directory of regions is removed
    path = tmp_path / "s"
    with TieredStore.from_config(ssd_only(path)) as store:
        assert all(store.put(["a", "b", "c"], [val(i, 3 * MiB) for i in range(3)]))
        assert store.flush()
        shutil.rmtree(path / "regions")
        assert store.put(["d"], [val(9, 1000)]) == [True]
        res = store.flush()
        tier = store.levels[0].tier.extra_stats()
        assert res.reasons.get(LOST) == tier["objects_lost"] == 3
        assert tier["objects"] == 1 and tier["large_objects"] == 0
        assert store.levels[0].tier.contains(["a", "b", "c", "d"]) == [False, False, False, True]
    with TieredStore.from_config(ssd_only(path)) as store:  # nothing of them comes back
        assert store.contains(["a", "b", "c", "d"]) == [False, False, False, True]
        assert store.levels[0].tier.extra_stats()["objects"] == 1


def test_a_large_object_whose_piece_went_with_its_region_counts_once_and_never_goes_negative(tmp_path):
    # a large object spans several regions: the file of one of its pieces is removed while the store runs
    path = tmp_path / "s"
    with TieredStore.from_config(ssd_only(path)) as store:
        tier = store.levels[0].tier
        assert all(store.put(["big"], [val(1, 3 * MiB)])) and all(store.put(["s"], [val(2, 1000)]))
        assert store.flush()
        first = sorted(os.listdir(path / "regions"))[0]  # sealed, a piece of "big" in it
        os.unlink(os.path.join(path, "regions", first))
        assert store.put(["t"], [val(3, 1000)]) == [True]
        res = store.flush()
        st = tier.extra_stats()
        assert res.reasons.get(LOST) == st["objects_lost"] == 1
        assert st["objects"] == 2 and st["large_objects"] == 0
        assert tier.contains(["big", "s", "t"]) == [False, True, True]


def test_a_smaller_capacity_at_reopen_trims_and_loses_whole_large_objects(tmp_path):
    # 11 chunks of 3 MiB in 64 MiB, reopened in 16 MiB: the newest that fit stay, the rest are counted once each
    path = tmp_path / "s"
    with TieredStore.from_config(ssd_only(path)) as store:
        assert all(store.put([f"k{i}" for i in range(11)], [val(i, 3 * MiB) for i in range(11)]))
    with TieredStore.from_config(ssd_only(path, "16MiB")) as store:
        kept = store.contains([f"k{i}" for i in range(11)]).count(True)
        dropped = 11 - kept
        assert 0 < kept < 11
        st = store.levels[0].tier.extra_stats()
        assert st["trimmed"] == st["objects_lost"] == dropped
        assert st["objects"] == st["large_objects"] == kept
        res = store.flush()
        assert res.reasons.get(LOST) == dropped


def test_a_large_object_missing_a_piece_at_reopen_is_dropped_whole_and_counted(tmp_path):
    path = tmp_path / "s"
    with TieredStore.from_config(ssd_only(path)) as store:  # the first region holds pieces of "big" alone
        assert all(store.put(["big"], [val(1, 3 * MiB)])) and all(store.put(["s"], [val(2, 1000)]))
    os.truncate(os.path.join(path, "regions", sorted(os.listdir(path / "regions"))[0]), 0)
    with TieredStore.from_config(ssd_only(path)) as store:
        assert store.contains(["big", "s"]) == [False, True]  # never claimed: it could only miss
        st = store.levels[0].tier.extra_stats()
        assert st["objects"] == 1 and st["objects_lost"] == 1
        assert store.flush().reasons.get(LOST) == 1


# -- finding: inspect --repair of a damaged large object ---------------------------------------------------
def test_inspect_names_a_damaged_large_object_by_its_key_and_repair_removes_it_whole(tmp_path):
    path = str(tmp_path / "s")
    v = val(1, 3 * MiB)
    with TieredStore.from_config(ssd_only(path)) as store:
        assert all(store.put(["bigkey", "small"], [v, val(2, 1000)]))
    flip_byte_of(path, v, 2 * MiB)  # a byte of one piece

    rep = inspect_dir(path, verify=True)
    assert [c["key"] for c in rep["corrupt_objects"]] == ["bigkey"]  # the key its user stored, no piece key
    assert "piece" in rep["corrupt_objects"][0]["reason"]
    assert rep["objects"] == 2

    r = tierkv("inspect", path, "--verify")
    assert r.returncode == 1 and "bigkey" in r.stdout and "\\x00" not in r.stdout and "\x00" not in r.stdout
    r = tierkv("inspect", path, "--verify", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["corrupt_keys"] == ["bigkey"]

    r = tierkv("inspect", path, "--repair")
    assert r.returncode == 0 and "removed bigkey" in r.stdout  # nothing remains damaged
    rep = inspect_dir(path, verify=True)
    assert rep["corrupt"] == 0 and rep["objects"] == 1
    assert tierkv("inspect", path, "--verify").returncode == 0
    with TieredStore.from_config(ssd_only(path)) as store:  # no object reads as present and misses
        assert store.lookup(["bigkey"]) == 0 and store.contains(["bigkey", "small"]) == [False, True]
        st = store.levels[0].tier.extra_stats()
        assert st["objects"] == 1 and st["large_objects"] == 0
        out = torch.empty(1000, dtype=torch.uint8)
        assert store.get(["small"], [out]) == [True] and torch.equal(out, val(2, 1000))


def test_inspect_reports_a_large_object_missing_a_piece_and_repair_removes_what_is_left(tmp_path):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, path, region_size="1MiB", direct_io=False)
    assert t.write(["big"], [[val(1, 3 * MiB)]]) == [True] and t.write(["s"], [[val(2, 1000)]]) == [True]
    t.close()
    os.unlink(os.path.join(path, "regions", sorted(os.listdir(os.path.join(path, "regions")))[0]))
    for verify in (False, True):  # known from the listings alone: plain mode says it too
        rep = inspect_dir(path, verify=verify)
        assert [c.get("key") for c in rep["corrupt_objects"] if "key" in c] == ["big"]
        assert "missing" in next(c for c in rep["corrupt_objects"] if c.get("key") == "big")["reason"]
    rep = inspect_dir(path, repair=True)
    assert [c["key"] for c in rep["removed"]] == ["big"]
    assert [c for c in rep["corrupt_objects"] if "key" in c] == [] and rep["objects"] == 1
    t = SSDTier("ssd", 64 * MiB, path, region_size="1MiB", direct_io=False)
    assert t.recover() == [("s", 1000)] and t.extra_stats()["objects"] == 1
    t.close()


def test_a_healthy_large_object_verifies_clean(tmp_path):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, path, region_size="1MiB", direct_io=False, compression="lz4")
    assert t.write(["big", "s"], [[val(1, 3 * MiB)], [val(2, 1000)]]) == [True, True]
    t.close()
    rep = inspect_dir(path, verify=True)
    assert rep["corrupt"] == 0 and rep["objects"] == 2 and rep["unverified"] == 0
