"""The ssd tier where its room runs out or goes away: a full file system, a directory removed behind a live
writer, a broken layout, a read-only volume.  Each fault is a counted, logged event or a ``ConfigError``
naming the path, never a silent loss or a raw ``OSError``."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from tier_conformance import blob, key

from tierkv.durability import TierFlushError
from tierkv.errors import ConfigError
from tierkv.tiers.ssd import SSDTier

MiB = 1 << 20
SIZE = 60000  # a chunk: 17 to a 1 MiB region


def read_exact(t, keys, seeds, n=SIZE) -> list[bool]:
    """Per key: read, and its bytes are exactly ``blob(seed, n)``."""
    outs = [torch.zeros(n, dtype=torch.uint8) for _ in keys]
    ok = t.read(keys, [[o] for o in outs])
    return [f and torch.equal(o, blob(s, n)) for f, o, s in zip(ok, outs, seeds)]


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of 8 MiB (skipped where mounting is not permitted)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("mounting a small tmpfs is not permitted here")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def fill(t, start=0, limit=400) -> list[int]:
    """Put chunks one at a time until the tier refuses one; the indices it took."""
    took = []
    for i in range(start, start + limit):
        if not t.write([key(i)], [[blob(i, SIZE)]])[0]:
            break
        took.append(i)
    return took


def _direct_ok(tmp_path) -> bool:
    try:
        SSDTier("probe", MiB, str(tmp_path / "probe"), direct_io=True).close()
        return True
    except ConfigError:
        return False


def remove_behind(d):
    """``rm -rf`` of a live tier's directory.  Its lock watcher may make the directory and ``LOCK`` again
    while the removal runs (the last ``rmdir`` then fails: the directory is in use): every other file goes."""
    shutil.rmtree(d, ignore_errors=True)
    assert not os.path.exists(os.path.join(d, "regions"))


def region_files(d):
    rd = os.path.join(d, "regions")
    return sorted(os.path.join(rd, f) for f in os.listdir(rd))


# -- a full file system --------------------------------------------------------------------------
def test_a_full_disk_takes_writes_again_after_half_the_chunks_are_removed(small_fs):
    """The tier's capacity is far beyond the file system's: it fills the disk, is refused (counted), and once
    every other chunk is removed (no region empties: removals are scattered) it reclaims its own regions and
    takes new chunks, which a reopen finds exact."""
    d = os.path.join(small_fs, "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    took = fill(t)
    assert len(took) > 40 and t.extra_stats()["enospc"] >= 1
    assert fill(t, 1000, 5) == []  # refused until something is removed
    removed = took[::2]
    t.delete([key(i) for i in removed])
    kept = sorted(set(took) - set(removed))
    new = fill(t, 1000, len(removed) // 2)
    assert len(new) == len(removed) // 2, "no write got in after half the chunks were removed"
    st = t.extra_stats()
    assert st["gc_disk_full"] >= 1 and st["gc_relocated"] >= 1
    assert all(read_exact(t, [key(i) for i in kept + new], kept + new))
    t.close()
    assert not [f for f in region_files(d) if os.path.getsize(f) == 0]
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    assert {k for k, _ in t.recover()} == {key(i) for i in kept + new}
    assert all(read_exact(t, [key(i) for i in kept + new], kept + new))
    more = fill(t, 2000)  # the room that is left, until refused again (counted)
    assert len(more) < 400 and t.extra_stats()["enospc"] >= 1
    t.delete([key(i) for i in new + more])
    assert fill(t, 3000, len(new)) == list(range(3000, 3000 + len(new)))
    t.close()


def test_a_disk_filled_behind_the_tier_is_compacted_in_place(small_fs):
    """Another writer takes the rest of the file system: the tier has no file to spare, so once removals
    leave room it compacts its emptiest region within its own file, and writes get in again."""
    d = os.path.join(small_fs, "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    took = fill(t, 0, 60)
    filler = os.path.join(small_fs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # the rest of the disk, 64 KiB at a time until it is full
        while os.write(fd, bytes(64 << 10)):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    more = fill(t, 500, 100)
    assert len(more) < 100
    took += more
    assert not [f for f in region_files(d) if os.path.getsize(f) == 0]  # (a failed creation leaves nothing)
    removed = took[::2]
    t.delete([key(i) for i in removed])
    kept = sorted(set(took) - set(removed))
    new = fill(t, 1000, 10)
    assert len(new) == 10
    assert t.extra_stats()["gc_in_place"] >= 1
    assert all(read_exact(t, [key(i) for i in kept + new], kept + new))
    t.close()
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    assert {k for k, _ in t.recover()} == {key(i) for i in kept + new}
    assert all(read_exact(t, [key(i) for i in kept + new], kept + new))
    t.close()


@pytest.mark.parametrize("direct", [False, True])
def test_a_failed_region_creation_leaves_no_file_and_the_tier_goes_on_in_place(tmp_path, monkeypatch, direct):
    """ENOSPC where the tier reserves a new region's blocks: the file it just created is removed (counted),
    the failure counted and logged, and the tier reclaims its own regions instead; a reopen finds exactly
    what is left."""
    if direct and not _direct_ok(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=direct)
    took = fill(t, 0, 40)  # three regions
    real = os.posix_fallocate

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    more = fill(t, 100, 40)
    assert len(more) < 40
    st = t.extra_stats()
    assert st["enospc"] >= 1 and st["partial_files_removed"] >= 1
    assert all(os.path.getsize(f) == MiB for f in region_files(d))
    removed = (took + more)[::2]
    t.delete([key(i) for i in removed])
    new = fill(t, 200, 8)
    assert len(new) == 8
    assert t.extra_stats()["gc_in_place"] >= 1
    monkeypatch.setattr(os, "posix_fallocate", real)
    t.close()
    left = sorted(set(took + more + new) - set(removed))
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=direct)
    assert {k for k, _ in t.recover()} == {key(i) for i in left}
    assert all(read_exact(t, [key(i) for i in left], left))
    t.close()


def test_region_files_never_begun_are_removed_at_open(tmp_path):
    """A zero-length region file, or one of zeros (a creation that failed or was cut short), is ours and
    holds nothing: the open removes it (counted) rather than skipping it as foreign at every open."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    t.write([key(1)], [[blob(1, 1000)]])
    t.close()
    rd = os.path.join(d, "regions")
    open(os.path.join(rd, "r000005.region"), "wb").close()
    with open(os.path.join(rd, "r000006.region"), "wb") as f:
        f.write(bytes(MiB))
    with open(os.path.join(rd, "r000007.region"), "wb") as f:
        f.write(b"not ours" * 100)  # (someone else's: kept)
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    st = t.extra_stats()
    assert st["partial_files_removed"] == 2 and st["skipped_files"] == 1
    assert sorted(os.listdir(rd)) == ["r000000.region", "r000007.region"]
    assert read_exact(t, [key(1)], [1], 1000) == [True]
    t.close()


def test_every_lack_of_room_is_counted_and_logged_at_a_limited_rate(tmp_path, monkeypatch, caplog):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    caplog.set_level("WARNING", logger="tierkv.tiers.ssd")
    oks = [t.write([key(i)], [[blob(i, SIZE)]])[0] for i in range(60)]
    assert not all(oks)
    n = t.extra_stats()["enospc"]
    assert n >= 60 - sum(oks)
    lines = [r for r in caplog.records if "no space" in r.getMessage()]
    assert 1 <= len(lines) < n
    t.close()


# -- a broken layout, a read-only volume ---------------------------------------------------------------
@pytest.mark.parametrize("broken", ["regions is a file", "LOCK is a directory", "checkpoint is a directory",
                                    "dead is a directory"])
def test_a_broken_layout_is_a_config_error_naming_the_path(tmp_path, broken):
    d = tmp_path / "s"
    d.mkdir()
    name, kind = broken.split(" is a ")
    (d / name).mkdir() if kind == "directory" else (d / name).write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"{d / name}.* not a"):
        SSDTier("ssd", 8 * MiB, str(d), region_size="1MiB")
    assert (d / name).exists()  # refused, nothing removed


@pytest.fixture
def read_only(tmp_path):
    """(directory holding a tier's files, the same seen through a read-only bind mount) or a skip."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    r = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("a read-only bind mount is not permitted here")
    try:
        yield str(src), str(ro)
    finally:
        subprocess.run(["umount", "-l", str(ro)])


@pytest.mark.parametrize("what", ["a tier's directory", "an empty directory", "a new directory"])
def test_a_read_only_volume_is_a_config_error_naming_the_path_and_the_cause(read_only, what):
    src, ro = read_only
    os.makedirs(os.path.join(src, "s"), mode=0o700)
    if what == "a tier's directory":
        t = SSDTier("ssd", 8 * MiB, os.path.join(src, "s"), region_size="1MiB")
        t.write([key(1)], [[blob(1, 1000)]])
        t.close()
    path = os.path.join(ro, "new" if what == "a new directory" else "s")
    with pytest.raises(ConfigError, match=rf"{path}.*[Rr]ead-only file system"):
        SSDTier("ssd", 8 * MiB, path, region_size="1MiB")


def test_the_store_reports_a_broken_ssd_directory_as_a_config_error(tmp_path):
    from tierkv import TieredStore

    d = tmp_path / "s"
    d.mkdir()
    (d / "regions").write_bytes(b"")
    cfg = {"tiers": [{"medium": "dram", "capacity": "1MiB"},
                     {"medium": "ssd", "path": str(d), "capacity": "8MiB", "region_size": "1MiB"}]}
    with pytest.raises(ConfigError, match=str(d / "regions")):
        TieredStore.from_config(cfg)


# -- a directory removed behind a live writer -----------------------------------------------------------
@pytest.mark.parametrize("direct", [False, True])
def test_chunks_written_after_the_directory_is_removed_are_all_found_after_a_reopen(tmp_path, direct):
    """The region active when the directory went keeps nothing only in the removed file: every chunk
    acknowledged and flushed after the removal is found, exact, by the next open; the objects that went
    with the removal are counted (``objects_lost``), and the tier's count matches what a reopen finds."""
    if direct and not _direct_ok(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=direct)
    t.write([key(i) for i in range(30)], [[blob(i, SIZE)] for i in range(30)])  # the second region half full
    t.flush()
    remove_behind(d)
    after = list(range(100, 200))
    for i in after:
        assert t.write([key(i)], [[blob(i, SIZE)]]) == [True]
    t.flush()
    st = t.extra_stats()
    assert st["dir_removed"] >= 1 and st["objects_lost"] >= 1
    objects = st["objects"]
    t.close()
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=direct)
    found = {k for k, _ in t.recover()}
    assert {key(i) for i in after} <= found, f"{len({key(i) for i in after} - found)} of 100 lost"
    assert len(found) == objects == 100 + 30 - st["objects_lost"]
    assert all(read_exact(t, [key(i) for i in after], after))
    t.close()


def test_a_removal_of_regions_alone_is_found_at_the_next_flush(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    t.write([key(i) for i in range(40)], [[blob(i, SIZE)] for i in range(40)])
    t.flush()
    shutil.rmtree(os.path.join(d, "regions"))  # a tmp cleaner: the sealed regions' objects go with it
    t.flush()
    st = t.extra_stats()
    assert st["dir_removed"] == 1 and st["objects"] == 40 - st["objects_lost"] and st["objects_lost"] > 0
    t.close()
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    found = sorted(k for k, _ in t.recover())
    assert len(found) == st["objects"]
    assert all(read_exact(t, found, [int(k[1:5]) for k in found]))
    t.close()


def test_an_old_region_file_removed_alone_is_found_at_the_next_flush(tmp_path):
    """A tmp cleaner removing old files: a sealed region written long before the last flush goes; its objects
    are dropped and counted at the next flush, so the tier's count is what a reopen finds."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    t.write([key(i) for i in range(60)], [[blob(i, SIZE)] for i in range(60)])
    t.flush()
    t.write([key(100)], [[blob(100, SIZE)]])
    t.flush()
    os.unlink(region_files(d)[0])
    t.flush()
    st = t.extra_stats()
    assert st["dir_removed"] == 1 and st["objects_lost"] > 0 and st["objects"] == 61 - st["objects_lost"]
    t.close()
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    found = sorted(k for k, _ in t.recover())
    assert len(found) == st["objects"] and key(100) in found
    assert all(read_exact(t, found, [int(k[1:5]) for k in found]))
    t.close()


def test_a_removed_active_region_that_cannot_be_recreated_answers_false_and_counts_its_objects(
        tmp_path, monkeypatch):
    """The directory is removed and the disk then has no room to recreate the active region's file: the
    write that finds it is answered False, the objects that went are counted (``objects_lost``), no more goes
    into the removed file, and writes go on into a new region once there is room."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    t.write([key(i) for i in range(5)], [[blob(i, SIZE)] for i in range(5)])
    remove_behind(d)
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    assert t.write([key(5)], [[blob(5, SIZE)]]) == [False]
    st = t.extra_stats()
    assert st["objects_lost"] == 6 and st["objects"] == 0 and st["enospc"] >= 1
    monkeypatch.setattr(os, "posix_fallocate", real)
    assert t.write([key(6)], [[blob(6, SIZE)]]) == [True]
    t.close()
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    assert [k for k, _ in t.recover()] == [key(6)]
    assert read_exact(t, [key(6)], [6]) == [True]
    t.close()


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from tier_conformance import blob, key
    from tierkv.tiers.ssd import SSDTier
    path, direct = sys.argv[1], sys.argv[2] == "1"
    t = SSDTier("ssd", 64 << 20, path, region_size="1MiB", direct_io=direct)
    t.write([key(i) for i in range(30)], [[blob(i, 60000)] for i in range(30)])
    t.flush()
    print("ready", flush=True)
    sys.stdin.readline()  # the directory is removed meanwhile
    oks = [t.write([key(i)], [[blob(i, 60000)]])[0] for i in range(100, 200)]
    print("written", sum(oks), flush=True)
    sys.stdin.readline()  # (killed here)
""")


def test_chunks_acknowledged_after_the_directory_is_removed_survive_sigkill_without_flush(tmp_path):
    d = str(tmp_path / "s")
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen([sys.executable, "-c", CHILD, d, "0", here], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        remove_behind(d)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["written", "100"]
    finally:
        child.kill()
        child.wait(30)
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    found = {k for k, _ in t.recover()}
    after = list(range(100, 200))
    assert {key(i) for i in after} <= found
    assert all(read_exact(t, [key(i) for i in after], after))
    t.close()


HOLDER = textwrap.dedent("""
    import sys
    from tierkv.tiers.ssd import SSDTier
    t = SSDTier("ssd", 1 << 20, sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    t.close()
""")


def test_a_second_process_is_refused_for_the_first_ones_whole_life_even_after_the_directory_is_removed(
        tmp_path):
    d = str(tmp_path / "s")
    child = subprocess.Popen([sys.executable, "-c", HOLDER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        remove_behind(d)  # the holder is idle: its watcher makes the directory and LOCK again
        lock = os.path.join(d, "LOCK")
        deadline = time.monotonic() + 30
        while R_holder(d) != child.pid:
            assert time.monotonic() < deadline, "the lock was not taken again"
            time.sleep(0.02)
        with pytest.raises(ConfigError, match=rf"{d}.*process {child.pid}"):
            SSDTier("ssd", MiB, d)
        assert os.path.isfile(lock)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)
    SSDTier("ssd", MiB, d).close()  # free again once the holder closed


def R_holder(d):
    from tierkv.tiers.ssd.lock import holder_pid

    return holder_pid(d)


def test_a_second_opener_in_this_process_is_refused_right_after_the_directory_is_removed(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", MiB, d)
    remove_behind(d)
    with pytest.raises(ConfigError, match=rf"{d}.*process {os.getpid()}"):
        SSDTier("ssd2", MiB, d)
    t.close()
    SSDTier("ssd3", MiB, d).close()


def test_a_lock_taken_by_another_opener_meanwhile_stops_every_write(tmp_path, monkeypatch):
    """If another opener took the recreated directory's lock first, the tier writes nothing more there:
    every write is refused and counted (``lock_lost``), flush and close write nothing."""
    import fcntl

    from tierkv.tiers.ssd import lock as L

    monkeypatch.setattr(L, "WATCH_INTERVAL", 3600.0)  # (the watcher would win the race)
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    t.write([key(1)], [[blob(1, SIZE)]])
    remove_behind(d)
    os.makedirs(d, exist_ok=True)
    fd = os.open(os.path.join(d, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (another opener)
    try:
        assert t.write([key(2)], [[blob(2, SIZE)]]) == [True]  # (found after this one: it is in the old file)
        assert t.write([key(3)], [[blob(3, SIZE)]]) == [False]
        assert t.extra_stats()["lock_lost"] == 1
        with pytest.raises(TierFlushError, match="lock_lost"):  # (nothing it holds can be made durable)
            t.flush()
        t.close()
        assert os.listdir(d) == ["LOCK"]  # nothing written into the other's directory
    finally:
        os.close(fd)
