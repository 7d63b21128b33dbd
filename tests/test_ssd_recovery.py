"""Reopening the ssd tier after a crash, damage or a smaller capacity: it always accepts writes, loses no
flushed object to a reused seq or a cut summary, and keeps to the disk its capacity provisions."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from tier_conformance import blob, key

from tierkv.tiers.ssd import SSDTier
from tierkv.tiers.ssd.format import key_digest
from tierkv.tiers.ssd.reclaim import Reclaimer

MiB = 1 << 20
CHUNK = 16 << 10


def val(i: int, n: int = CHUNK) -> torch.Tensor:
    return torch.full((n,), i % 251, dtype=torch.uint8)


def copy_dir(src: str, dst: str) -> str:
    """What a SIGKILL at this moment leaves: the files as the page cache holds them (the lock aside)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("LOCK"))
    return dst


def disk_bytes(path: str) -> int:
    """Bytes the tier's files take (apparent sizes: region files are preallocated whole)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def region_bound(t: SSDTier) -> int:
    return t.regions_needed() * t.region_size


def read_exact(t: SSDTier, keys, fill) -> list[bool]:
    """Whether each key reads back as exactly ``fill(i)`` (a wrong byte fails the assertion)."""
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in keys]
    ok = t.read(list(keys), [[o] for o in outs])
    for k, f, o in zip(keys, ok, outs):
        if f:
            assert torch.equal(o, fill(k)), f"wrong bytes for {k}"
    return ok


def _fill(k: str) -> torch.Tensor:
    return val(int(k[1:]))


def _accepts_writes(t: SSDTier, tag: str, n: int = 20) -> None:
    names = [f"{tag}{j}" for j in range(n)]
    assert t.write(names, [[val(j)] for j in range(n)]) == [True] * n, t.extra_stats()
    assert t.extra_stats()["enospc"] == 0


def _churn_until_reclaimed(t: SSDTier, rng: random.Random, live: list, n: int, runs: int, on_gc) -> int:
    """Put 4, remove 4 at random, flushing every few steps, until ``runs`` reclamations have been seen."""
    gc = t.extra_stats()["gc_runs"]
    step = 0
    while runs:
        ks = list(range(n, n + 4))
        n += 4
        assert t.write([f"k{i}" for i in ks], [[val(i)] for i in ks]) == [True] * 4
        live += ks
        gone = rng.sample(live, 4)
        for x in gone:
            live.remove(x)
        t.delete([f"k{i}" for i in gone])
        step += 1
        if step % 5 == 0:
            t.flush()
        g = t.extra_stats()["gc_runs"]
        if g > gc:
            gc = g
            on_gc()
            runs -= 1
    return n


def test_a_copy_taken_right_after_a_reclamation_reopens_accepting_writes(tmp_path):
    """6 MiB, 1 MiB regions, ~200 live 16 KiB chunks churned; a crash image right after each reclamation."""
    live_dir = str(tmp_path / "live")
    t = SSDTier("ssd", 6 * MiB, live_dir, region_size="1MiB")
    rng = random.Random(1)
    live = list(range(200))
    t.write([f"k{i}" for i in live], [[val(i)] for i in live])
    t.flush()
    copies: list[tuple[str, set]] = []
    _churn_until_reclaimed(t, rng, live, 200, 6, lambda: copies.append(
        (copy_dir(live_dir, str(tmp_path / f"c{len(copies)}")), set(live))))
    t.close()
    for path, _ in copies:
        u = SSDTier("ssd", 6 * MiB, path, region_size="1MiB")
        found = [k for k, _ in u.recover()]
        assert all(read_exact(u, found, _fill))
        _accepts_writes(u, "new")
        assert u.extra_stats()["regions_free"] + (u._state.table.active is not None) >= 1
        u.close()
        assert disk_bytes(os.path.join(path, "regions")) <= region_bound(u)


@pytest.mark.parametrize("direct,way", [(False, "resume"), (True, "resume"), (False, "in_place")])
def test_a_crash_in_the_middle_of_a_reclamation_reopens_accepting_writes_and_losing_nothing(tmp_path, monkeypatch,
                                                                                             direct, way):
    """Half the victim's copies in the file, the dead log not yet naming the victim's records: every region
    holds live objects at the reopen, which must still find a region to write into (and lose nothing).
    ``in_place``: as if the newest region could not be filled on: one is compacted within its own file."""
    live_dir = str(tmp_path / "live")
    t = SSDTier("ssd", 6 * MiB, live_dir, region_size="1MiB", direct_io=direct)
    rng = random.Random(2)
    live = list(range(200))
    t.write([f"k{i}" for i in live], [[val(i)] for i in live])
    t.flush()
    crash: list[tuple[str, set]] = []
    real_move = Reclaimer.settle_move

    def move_then_crash(self, dest):
        half = dest.pos // 2 // 4096 * 4096  # the kill lands halfway through the copies' write-out
        self._io.write_out(dest, half, half)
        if not crash:
            crash.append((copy_dir(live_dir, str(tmp_path / "crash")), {f"k{i}" for i in live}))
        real_move(self, dest)

    monkeypatch.setattr(Reclaimer, "settle_move", move_then_crash)
    _churn_until_reclaimed(t, rng, live, 200, 1, lambda: None)
    t.close()
    ((path, flushed),) = crash
    if way == "in_place":
        monkeypatch.setattr(SSDTier, "_to_resume", lambda self, valid, scanned, dead: None)
    u = SSDTier("ssd", 6 * MiB, path, region_size="1MiB", direct_io=direct)
    assert u.extra_stats()["gc_in_place"] == (way == "in_place")
    listed = [k for k, _ in u.recover()]
    found = set(listed)
    assert len(listed) == len(found) == u.extra_stats()["objects"]  # a key copied twice is one object
    assert u.extra_stats()["gc_runs"] >= 1  # every region held objects: the open finished the reclamation
    assert found >= flushed, "an object was lost"
    assert all(read_exact(u, sorted(found), _fill))
    _accepts_writes(u, "new", 60)
    st = u.extra_stats()
    assert st["trimmed"] == 0 and st["enospc"] == 0
    u.close()
    assert disk_bytes(os.path.join(path, "regions")) <= region_bound(u)
    v = SSDTier("ssd", 6 * MiB, path, region_size="1MiB", direct_io=direct)
    assert {k for k, _ in v.recover()} >= found
    _accepts_writes(v, "again", 60)
    v.close()


@pytest.mark.parametrize("damage", ["lost", "header-bit"])
def test_a_damaged_newest_region_never_costs_the_objects_written_after_it(tmp_path, damage):
    """The newest region's seq must not be handed out again: the dead log names records by it."""
    live_dir = str(tmp_path / "live")
    t = SSDTier("ssd", 16 * MiB, live_dir, region_size="1MiB")
    for i in range(80):  # several regions; the newest holds some objects, and removals name them
        t.write([f"k{i}"], [[val(i)]])
    newest = t._state.table.active
    in_newest = [f"k{i}" for i in range(80) if t._state.catalogue.index.get(key_digest(f"k{i}".encode()))[0] == newest.index]
    assert len(in_newest) >= 10
    t.delete(in_newest[:len(in_newest) // 2])
    t.flush()
    path = copy_dir(live_dir, str(tmp_path / "crash"))
    t.close()
    victim = os.path.join(path, "regions", os.path.basename(newest.path))
    if damage == "lost":
        os.unlink(victim)
    else:
        with open(victim, "r+b") as f:  # one bit of the header's seq
            f.seek(12)
            b = f.read(1)
            f.seek(12)
            f.write(bytes([b[0] ^ 1]))
    u = SSDTier("ssd", 16 * MiB, path, region_size="1MiB")
    u.recover()
    after = [f"n{i}" for i in range(30)]
    assert u.write(after, [[val(i)] for i in range(30)]) == [True] * 30
    u.flush()
    u.close()
    v = SSDTier("ssd", 16 * MiB, path, region_size="1MiB")
    found = {k for k, _ in v.recover()}
    assert set(after) <= found, f"{len(set(after) - found)} of 30 objects written after the damage were lost"
    assert all(read_exact(v, after, lambda k: val(int(k[1:]))))
    v.close()


def test_an_object_in_a_region_whose_summary_was_cut_survives_the_next_checkpoint(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    t.write([key(i) for i in range(80)], [[blob(i, 40000)] for i in range(80)])
    first = t._state.table.regions[0].path
    t.close()
    size = os.path.getsize(first)
    with open(first, "r+b") as f:  # the summary's tail and footer cut (zeroed)
        f.seek(size - 8192)
        f.write(bytes(8192))
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")  # from the checkpoint: region 0 is not read
    before = {k for k, _ in t.recover()}
    assert len(before) == 80
    t.write(["extra"], [[blob(999, 100)]])
    t.checkpoint()  # gathers every key from the summaries
    st = t.extra_stats()
    t.close()
    assert st["summaries_rebuilt"] >= 1 and st["corrupt"] == 0
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    found = {k for k, _ in t.recover()}
    assert before <= found, f"{len(before - found)} undamaged objects were dropped"
    outs = [torch.zeros(40000, dtype=torch.uint8) for _ in range(80)]
    assert t.read([key(i) for i in range(80)], [[o] for o in outs]) == [True] * 80
    assert all(torch.equal(o, blob(i, 40000)) for i, o in enumerate(outs))
    t.close()


def test_reopening_smaller_keeps_the_newest_that_fit_and_the_disk_within_the_bound(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 12 * MiB, d, region_size="1MiB")
    rng = random.Random(3)
    live = list(range(500))
    for i in live:
        t.write([f"k{i}"], [[val(i)]])
    n = 500
    for _ in range(150):  # churn: live objects spread over every region
        gone = rng.sample(live, 3)
        for x in gone:
            live.remove(x)
        t.delete([f"k{i}" for i in gone])
        t.write([f"k{i}" for i in range(n, n + 3)], [[val(i)] for i in range(n, n + 3)])
        live += range(n, n + 3)
        n += 3
    t.close()
    assert disk_bytes(os.path.join(d, "regions")) > 12 * MiB
    u = SSDTier("ssd", 2 * MiB, d, region_size="1MiB")
    found = [k for k, _ in u.recover()]
    st = u.extra_stats()
    assert disk_bytes(os.path.join(d, "regions")) <= region_bound(u), st
    assert st["regions"] <= u.regions_needed() and st["regions_removed"] > 0
    assert st["trimmed"] == len(live) - len(found) > 0
    assert sum(u.footprint(CHUNK) for _ in found) <= 2 * MiB
    newest = [f"k{i}" for i in live[-len(found) // 2:]]
    assert set(newest) <= set(found), "the newest objects were not kept"
    assert all(read_exact(u, found, _fill))
    for j in range(200):  # and it goes on working within the bound
        assert u.write([f"m{j}"], [[val(j)]]) == [True]
        u.delete([f"m{j - 40}"]) if j >= 40 else None
    assert disk_bytes(os.path.join(d, "regions")) <= region_bound(u)
    u.close()
    v = SSDTier("ssd", 2 * MiB, d, region_size="1MiB")
    assert {f"m{j}" for j in range(160, 200)} <= {k for k, _ in v.recover()}
    assert disk_bytes(os.path.join(d, "regions")) <= region_bound(v)
    v.close()


def test_a_store_over_a_crashed_ssd_tier_stores_what_it_says_it_stores(tmp_path, monkeypatch):
    """dram above ssd: after a crash in the middle of a reclamation the store's puts land on the ssd tier."""
    from tierkv import TieredStore

    live_dir = str(tmp_path / "live")

    def cfg(path):
        return {"tiers": [{"medium": "dram", "capacity": "256KiB"},
                          {"medium": "ssd", "path": path, "capacity": "6MiB", "region_size": "1MiB",
                           "persist": "write_through"}]}

    crash: list = []
    real_move = Reclaimer.settle_move

    def move_then_crash(self, dest):
        half = dest.pos // 2 // 4096 * 4096
        self._io.write_out(dest, half, half)
        if not crash:
            crash.append(copy_dir(live_dir, str(tmp_path / "crash")))
        real_move(self, dest)

    monkeypatch.setattr(Reclaimer, "settle_move", move_then_crash)
    keys = [f"{i:064x}" for i in range(2000)]
    rng = random.Random(4)
    with TieredStore.from_config(cfg(live_dir)) as store:
        live = keys[:200]
        assert store.put(live, [val(i) for i in range(200)]) == [True] * 200
        store.flush()
        n = 200
        while not crash:
            assert store.put(keys[n:n + 4], [val(i) for i in range(n, n + 4)]) == [True] * 4
            live += keys[n:n + 4]
            n += 4
            gone = rng.sample(live, 4)
            for k in gone:
                live.remove(k)
            store.remove(gone)
    monkeypatch.setattr(Reclaimer, "settle_move", real_move)
    new = [f"{i:064x}" for i in range(10000, 10040)]
    with TieredStore.from_config(cfg(crash[0])) as store:
        assert store.put(new, [val(i) for i in range(40)]) == [True] * 40
        assert store.flush()
        assert store.locate(new).count("ssd") + store.locate(new).count("dram") == 40
        assert store.stats()["ssd"]["enospc"] == 0
    t = SSDTier("ssd", 6 * MiB, crash[0], region_size="1MiB")
    assert set(new) <= {k for k, _ in t.recover()}, "a put the store answered True for is not on the ssd tier"
    t.close()


@pytest.mark.parametrize("cut", ["header-only", "empty-records"])
def test_a_region_cut_to_its_header_costs_its_objects_and_nothing_else(tmp_path, cut):
    """A sealed region cut short after a clean close (its records gone, the checkpoint still listing them):
    the reopen trusts the checkpoint, the next checkpoint finds nothing in the region; its objects are
    dropped and counted, the close succeeds and every other object is kept."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    names = [f"k{i}" for i in range(150)]  # several regions
    assert t.write(names, [[val(i)] for i in range(150)]) == [True] * 150
    newest = t._state.table.active
    in_newest = {k for k in names if t._state.catalogue.index.get(key_digest(k.encode()))[0] == newest.index}
    assert 0 < len(in_newest) < len(names)
    t.close()
    victim = os.path.join(d, "regions", os.path.basename(newest.path))
    if cut == "header-only":
        os.truncate(victim, 4096)
    else:  # the file keeps its size, its records and summary zeroed
        size = os.path.getsize(victim)
        with open(victim, "r+b") as f:
            f.seek(4096)
            f.write(bytes(size - 4096))
    u = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    u.recover()
    after = [f"n{i}" for i in range(30)]
    assert u.write(after, [[val(i)] for i in range(30)]) == [True] * 30
    u.checkpoint()  # gathers every key: the cut region names none of those the index holds there
    st = u.extra_stats()
    u.close()
    assert st["objects_lost"] >= len(in_newest) or st["corrupt"] >= len(in_newest), st
    v = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    found = {k for k, _ in v.recover()}
    others = [k for k in names if k not in in_newest]
    assert set(after) | set(others) <= found
    assert not found & in_newest
    assert all(read_exact(v, others + after, lambda k: val(int(k[1:]))))
    v.close()


@pytest.mark.parametrize("seed", range(12))
def test_random_damage_to_regions_and_checkpoint_costs_misses_only(tmp_path, seed):
    """A closed directory damaged at random (bits flipped, files cut (to a region's header too), zeroed,
    deleted or grown, in region files and the checkpoint; the dead log intact): the reopen serves exact bytes
    or misses, never raises, accepts writes, keeps what is written after the damage and brings back no
    removed object."""
    rng = random.Random(seed)
    d = str(tmp_path / "s")
    comp = rng.choice([None, "lz4"])
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB", compression=comp)
    live: dict[str, int] = {}
    removed: set[str] = set()
    for i in range(rng.randint(50, 400)):
        assert t.write([f"a{i}"], [[val(i)]]) == [True]
        live[f"a{i}"] = i
        if rng.random() < 0.3:
            k = rng.choice(list(live))
            t.delete([k])
            del live[k]
            removed.add(k)
        if rng.random() < 0.05:
            t.flush()
    t.close()
    files = sorted(os.path.join(d, "regions", f) for f in os.listdir(os.path.join(d, "regions")))
    files.append(os.path.join(d, "checkpoint"))
    for _ in range(rng.randint(1, 3)):
        f = rng.choice(files)
        if not os.path.exists(f):
            continue
        size = os.path.getsize(f)
        kind = rng.choice(["flip", "cut", "header", "zero", "delete", "grow"])
        if kind == "flip" and size:
            with open(f, "r+b") as fh:
                p = rng.randrange(size)
                fh.seek(p)
                b = fh.read(1)
                fh.seek(p)
                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        elif kind == "cut":
            os.truncate(f, rng.randrange(size + 1))
        elif kind == "header":  # a region's records and summary gone, its header kept
            os.truncate(f, min(size, 4096))
        elif kind == "zero" and size:
            p = rng.randrange(size)
            with open(f, "r+b") as fh:
                fh.seek(p)
                fh.write(bytes(min(rng.randint(1, 65536), size - p)))
        elif kind == "delete":
            os.unlink(f)
        elif kind == "grow":
            with open(f, "ab") as fh:
                fh.write(rng.randbytes(rng.randint(1, 9000)))
    u = SSDTier("ssd", 8 * MiB, d, region_size="1MiB", compression=comp)
    u.recover()
    after = [f"n{i}" for i in range(30)]
    assert u.write(after, [[val(1000 + i)] for i in range(30)]) == [True] * 30
    read_exact(u, list(live), lambda k: val(live[k]))
    u.flush()
    u.checkpoint()
    u.close()
    v = SSDTier("ssd", 8 * MiB, d, region_size="1MiB", compression=comp)
    found = {k for k, _ in v.recover()}
    assert set(after) <= found
    assert all(read_exact(v, after, lambda k: val(1000 + int(k[1:]))))
    assert not found & removed, f"{len(found & removed)} removed objects came back"
    read_exact(v, [k for k in live if k in found], lambda k: val(live[k]))
    v.close()
