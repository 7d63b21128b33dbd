"""The ssd tier through faults that pass, a failed fsync, and a directory lost behind it, seen through the store.

* A passing fault (a permission error, a full or failing device) makes the tier not writable for as long as it
  lasts: ``available`` and the tier's ``writable`` say False and ``last_error`` names the cause, puts answer
  False, and the tier writes again on its own once the cause is gone (a probe with backoff).  Only another live
  process holding the directory's lock stops writes for good, named (``lock_lost``, ``lock_holder``).
* A failed fsync makes ``flush()`` false, naming the tier and counting the chunks it cannot call durable; the
  next flush after the fault is true again.
* Chunks that went with a directory removed behind the tier leave the store's index: ``lookup``, ``contains``
  and ``locate`` claim only what reads, ``entries`` equals the tier's ``objects``, and ``flush()``'s ``lost``
  counts them.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from tierkv import TieredStore, metrics

SIZE = 16 << 10
HERE = os.path.dirname(os.path.abspath(__file__))


def val(i: int) -> torch.Tensor:
    return torch.full((SIZE,), i % 251, dtype=torch.uint8)


def ssd_store(path: str) -> TieredStore:
    return TieredStore.from_config({"tiers": [{"medium": "ssd", "path": path, "capacity": "64MiB",
                                               "region_size": "1MiB", "direct_io": False}]})


def tier_stats(s: TieredStore) -> dict:
    return s.stats()["tiers"]["ssd"]


def wait_until(cond, what: str, limit: float = 60.0) -> None:
    """Poll ``cond`` until it holds (the bound only turns a hang into a failure)."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def readable(s: TieredStore, keys: list[str]) -> list[bool]:
    outs = [torch.empty(SIZE, dtype=torch.uint8) for _ in keys]
    oks = s.get(keys, outs)
    for k, o, ok in zip(keys, outs, oks):
        if ok:
            assert torch.equal(o, val(int(k[1:]))), k
    return oks


# -- a passing permission error -----------------------------------------------------------------------------

CHMOD = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[2])
    import torch
    from test_ssd_fault_recovery import readable, ssd_store, tier_stats, val, wait_until
    import tierkv.tiers.ssd  # (a medium's module is imported when a store first names it)
    d, (uid, gid) = sys.argv[1], map(int, sys.argv[3].split(":"))
    if uid >= 0:  # (the interpreter and the checkout may live where only root reads: everything is imported first)
        os.setgid(gid)
        os.setuid(uid)
    s = ssd_store(d)
    out = {"before": s.put(["k1"], [val(1)])}
    os.chmod(d, 0)  # (as a user the permission applies to)
    wait_until(lambda: not tier_stats(s)["available"], "the fault was not seen")
    out["during"] = s.put(["k2"], [val(2)])
    st = tier_stats(s)
    out["writable"], out["last_error"] = st["writable"], st["last_error"]
    out["read_during"] = readable(s, ["k1"])
    os.chmod(d, 0o700)
    wait_until(lambda: tier_stats(s)["available"], "the tier did not write again")
    out["after"] = s.put(["k3"], [val(3)])
    out["read_after"] = readable(s, ["k1", "k2", "k3"])
    st = tier_stats(s)
    out["lock_lost"], out["lock_holder"], out["last_error_after"] = st["lock_lost"], st["lock_holder"], st["last_error"]
    out["flush"] = bool(s.flush())
    s.close()
    print(json.dumps(out))
""")


def test_a_directory_made_unreadable_then_restored_takes_writes_again(tmp_path):
    """The real thing: ``chmod 000`` of the tier's directory as a user the permission applies to (root is
    not: the child drops to ``nobody``), then restored while the store stays open."""
    base = tempfile.mkdtemp(prefix="tierkv-perm-", dir="/tmp")
    try:
        uid = gid = -1
        if os.geteuid() == 0:
            import pwd

            nobody = pwd.getpwnam("nobody")
            os.chown(base, nobody.pw_uid, nobody.pw_gid)
            uid, gid = nobody.pw_uid, nobody.pw_gid
        env = dict(os.environ, GLOG_minloglevel="2")
        got = subprocess.run([sys.executable, "-c", CHMOD, os.path.join(base, "s"), HERE, f"{uid}:{gid}"],
                             capture_output=True, text=True, env=env, timeout=300, cwd=base)
        assert got.returncode == 0, got.stderr[-3000:]
        out = json.loads(got.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", base], check=False)
        shutil.rmtree(base, ignore_errors=True)
    assert out["before"] == [True]
    assert out["during"] == [False] and out["writable"] is False
    assert "Permission denied" in out["last_error"]
    assert out["read_during"] == [True]  # (what it holds is still read)
    assert out["after"] == [True]
    assert out["read_after"] == [True, False, True]
    assert out["lock_lost"] == 0 and out["lock_holder"] is None and out["last_error_after"] == ""
    assert out["flush"] is True


def test_an_injected_permission_error_lasts_only_as_long_as_its_cause(tmp_path, monkeypatch):
    d = str(tmp_path / "s")
    s = ssd_store(d)
    assert s.put(["k1"], [val(1)]) == [True]
    real_stat = os.stat
    denied = [True]

    def stat(p, *a, **kw):
        if denied[0] and isinstance(p, str) and p.startswith(d):
            raise PermissionError(errno.EACCES, "Permission denied", p)
        return real_stat(p, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)
    wait_until(lambda: not s.levels[0].tier.available, "the fault was not seen")
    assert s.put(["k2"], [val(2)]) == [False]
    st = tier_stats(s)
    assert st["available"] is False and st["writable"] is False and "Permission denied" in st["last_error"]
    doc = metrics.status_document(metrics.snapshot(s))  # (what the exporter's /status serves)
    assert not doc["healthy"] and any("tier ssd is unavailable" in p and "Permission denied" in p
                                      for p in doc["problems"])
    assert readable(s, ["k1"]) == [True]
    denied[0] = False
    wait_until(lambda: s.levels[0].tier.available, "the tier did not write again")
    assert metrics.status_document(metrics.snapshot(s))["healthy"]
    assert s.put(["k2"], [val(2)]) == [True]
    assert readable(s, ["k1", "k2"]) == [True, True]
    st = tier_stats(s)
    assert st["lock_lost"] == 0 and st["lock_holder"] is None and st["writable"] is True
    assert s.flush()
    s.close()
    t = ssd_store(d)  # what it took is found by a reopen
    assert readable(t, ["k1", "k2"]) == [True, True]
    t.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_device_that_refuses_writes_for_a_while_is_not_writable_until_it_takes_them(tmp_path, monkeypatch, err):
    """ENOSPC or EIO from every write into a region file (a thin volume full, a failing path), then none."""
    d = str(tmp_path / "s")
    s = ssd_store(d)
    assert s.put(["k1"], [val(1)]) == [True]
    refused = [0]
    failing = [True]
    real_pwrite, real_pwritev = os.pwrite, os.pwritev

    def pwrite(fd, data, off):
        if failing[0]:
            refused[0] += 1
            raise OSError(err, os.strerror(err))
        return real_pwrite(fd, data, off)

    def pwritev(fd, bufs, off):
        if failing[0]:
            refused[0] += 1
            raise OSError(err, os.strerror(err))
        return real_pwritev(fd, bufs, off)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", pwritev)
    assert s.put(["k2"], [val(2)]) == [False]
    st = tier_stats(s)
    assert st["available"] is False and st["writable"] is False and os.strerror(err) in st["last_error"]
    assert s.put(["k3"], [val(3)]) == [False]  # (refused by the store: the tier is not writable)
    seen = refused[0]
    wait_until(lambda: refused[0] >= seen + 2, "the tier never probed the device")  # two probes failed
    assert not s.levels[0].tier.available  # still not writable: the cause lasts
    failing[0] = False
    wait_until(lambda: s.levels[0].tier.available, "the tier did not write again")
    assert s.put(["k2", "k3"], [val(2), val(3)]) == [True, True]
    assert readable(s, ["k1", "k2", "k3"]) == [True, True, True]
    assert tier_stats(s)["last_error"] == ""
    assert s.flush()
    s.close()


TAKER = textwrap.dedent("""
    import fcntl, os, sys
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)
    fd = os.open(os.path.join(d, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\\n".encode())
    print("held", flush=True)
    sys.stdin.readline()
""")


def test_only_a_takeover_by_another_live_process_stops_writes_for_good_and_names_it(tmp_path, monkeypatch):
    from tierkv.tiers.ssd import lock as L

    monkeypatch.setattr(L, "WATCH_INTERVAL", 3600.0)  # (the watcher would win the race)
    d = str(tmp_path / "s")
    s = ssd_store(d)
    assert s.put(["k1"], [val(1)]) == [True]
    shutil.rmtree(d)
    taker = subprocess.Popen([sys.executable, "-c", TAKER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert taker.stdout.readline().strip() == "held"
        s.put(["k2"], [val(2)])  # (the write finds the removal; the lock is another live process's)
        st = tier_stats(s)
        assert st["available"] is False and st["writable"] is False
        assert st["lock_holder"] == taker.pid and f"lock_lost: process {taker.pid}" in st["last_error"]
        assert s.put(["k3"], [val(3)]) == [False]
        res = s.flush()
        assert not res and "ssd" in res.tier_errors
    finally:
        taker.stdin.write("\n")
        taker.stdin.flush()
        taker.wait(30)
    assert not s.levels[0].tier.available  # for good: the directory was someone else's
    s.close()


# -- a failed fsync ------------------------------------------------------------------------------------------

def test_a_failed_fsync_makes_flush_false_naming_the_tier_and_the_next_one_true(tmp_path, monkeypatch):
    s = ssd_store(str(tmp_path / "s"))
    keys = [f"k{i}" for i in range(10)]
    assert s.put(keys, [val(i) for i in range(10)]) == [True] * 10

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    monkeypatch.setattr(os, "fsync", eio)
    res = s.flush()
    assert not res
    assert "ssd" in res.tier_errors and "Input/output error" in res.tier_errors["ssd"]
    assert res.not_durable == 10 and res.reasons == {"write_failed": 10}
    monkeypatch.undo()
    assert s.put(["k10"], [val(10)]) == [True]
    assert s.flush()
    assert readable(s, [*keys, "k10"]) == [True] * 11
    s.close()


# -- a directory lost behind the tier ------------------------------------------------------------------------

def _flushed_200(tmp_path):
    """An SSD-only store at ``tmp_path/s`` holding 200 chunks, flushed; (store, its directory, the keys)."""
    d = str(tmp_path / "s")
    s = ssd_store(d)
    keys = [f"k{i}" for i in range(200)]
    assert s.put(keys, [val(i) for i in range(200)]) == [True] * 200
    assert s.flush()
    return s, d, keys


def test_the_index_forgets_what_went_with_a_removed_directory(tmp_path):
    s, d, keys = _flushed_200(tmp_path)
    shutil.rmtree(d)  # (the watcher makes it and LOCK again; the regions went)
    assert s.put(["k200"], [val(200)]) == [True]
    res = s.flush()
    st = tier_stats(s)
    assert st["objects_lost"] > 0 and st["dir_removed"] >= 1
    assert res.reasons.get("lost") == st["objects_lost"] and not res
    everything = [*keys, "k200"]
    claimed = s.contains(everything)  # (asked before any read: a failed read drops its key too)
    located = [x is not None for x in s.locate(everything)]
    leading = s.lookup(everything)
    st = tier_stats(s)
    assert st["entries"] == st["objects"] == sum(claimed)
    got = readable(s, everything)
    assert got[-1] and sum(got) == 201 - st["objects_lost"]
    assert claimed == located == got
    assert leading == (got.index(False) if False in got else len(got))
    s.close()


def test_a_leased_chunk_lost_with_its_directory_is_unheld_and_its_pin_let_go(tmp_path):
    # a lease holds every chunk; the regions go behind the tier: the chunks the index forgets leave the lease
    # (``unheld``), so a loader holding it asks no tier for them and no pin outlives them
    s, d, keys = _flushed_200(tmp_path)
    lease = s.lease(keys, 60)
    assert lease.held == 200 and lease.unheld == []
    shutil.rmtree(d)
    assert s.put(["k200"], [val(200)]) == [True]
    s.flush()  # (the loss is noticed here: the index forgets what the medium no longer holds)
    lost = [k for k, c in zip(keys, s.contains(keys)) if not c]
    assert lost, "the regions went: some chunk must be gone"
    assert sorted(lease.unheld) == sorted(lost) and lease.held == 200 - len(lost)
    lease.release()
    assert s.lease(["k200"], 60).held == 1
    st = s.stats()["total"]
    assert st["leases_active"] == 1, st
    s.close()
