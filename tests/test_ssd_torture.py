"""Crash torture of the ssd tier: a writer killed at random points, again and again, on one directory.

A child process writes, removes and flushes through an ``SSDTier`` (in some rounds through a
``TieredStore`` with a ``dram`` tier above it) while its regions fill and are reclaimed, and reports on
a pipe each removal it is about to make and, after each flush, the puts and removals that flush made
durable.  The parent kills it with SIGKILL a random time after a random report, reopens the directory
and checks: no flushed chunk lost, no chunk whose removal was flushed back, no wrong byte, the tier
accepting writes, and its region files within ``regions_needed() * region_size``.  Three directories
(page cache, O_DIRECT, lz4) take 18 kills each.  Each round's seed is in the failure message: the
same seed replays the child's operations.

Children are forked from a forkserver that imported torch and tierkv once, so a round costs the
work, not an interpreter start.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from tierkv import TieredStore
from tierkv.tiers.ssd import SSDTier

MiB = 1 << 20
CAPACITY = 6 * MiB
REGION = "1MiB"
LIVE = 200  # objects the child keeps (about 2.6 MiB of 6: room for unflushed removals that come back)
ROUNDS = 18  # kills per directory
MODES = {"buffered": {"direct_io": False}, "direct": {"direct_io": True}, "lz4": {"compression": "lz4"}}


def name(gen: int, n: int) -> str:
    return f"{gen:08x}{n:056x}"


def value(k: str) -> np.ndarray:
    """The bytes of chunk ``k``: 4-24 KiB, half of them compressible; one in 29 is 137-257 KB, more than one
    record of a 1 MiB region holds (pieces and a manifest: ``tiers/ssd/large.py``)."""
    s = int(k[-12:], 16) * 7919 + int(k[:8], 16)
    size = 4096 + (s % 5) * 5000 if s % 29 else 137_000 + (s % 7) * 20_000
    if s % 2:
        return np.frombuffer(np.random.default_rng(s).bytes(size), dtype=np.uint8)
    return np.resize(np.frombuffer(s.to_bytes(8, "little") * 4, dtype=np.uint8), size)


def _options(mode: str, store: bool) -> dict:
    return {**MODES[mode], "fsync": "flush" if store else "never"}


def _open_tier(path: str, mode: str, store: bool) -> SSDTier:
    return SSDTier("ssd", CAPACITY, path, region_size=REGION, **_options(mode, store))


def _child(path: str, mode: str, store: bool, seed: int, gen: int, live: list, conn) -> None:
    """Write, remove and flush until killed, reporting on ``conn`` (one line a message)."""
    rng = random.Random(seed)

    def say(line: str) -> None:
        conn.send_bytes(line.encode())

    if store:
        cfg = {"tiers": [{"medium": "dram", "capacity": "256KiB"},
                         {"medium": "ssd", "path": path, "capacity": CAPACITY, "region_size": REGION,
                          "persist": "write_through", **_options(mode, store)}]}
        s = TieredStore.from_config(cfg)
        tier = s.levels[1].tier

        def put(ks: list) -> list:
            return s.put(ks, [torch.from_numpy(value(k).copy()) for k in ks])

        remove, flush = s.remove, s.flush
    else:
        t = tier = _open_tier(path, mode, store)
        t.recover()

        def put(ks: list) -> list:
            return t.write(ks, [[torch.from_numpy(value(k).copy())] for k in ks])

        def remove(ks: list) -> None:
            t.delete(ks)

        def flush() -> bool:
            t.flush()
            return True

    say("ready")
    live = list(live)
    puts: list = []
    gone: list = []
    n = gc = 0
    flush_rate = rng.choice([0.35, 0.04])  # (rarely: reclamations follow one another between flushes)
    while True:
        ks = [name(gen, n + j) for j in range(rng.randint(1, 4))]
        n += len(ks)
        ok = put(ks)
        g = tier.extra_stats()["gc_runs"]
        if g > gc:  # (a handshake right after a reclamation: its dead-log entries are not flushed yet)
            gc = g
            say(f"gc {g}")
        if not all(ok):
            say("refused " + ",".join(k for k, o in zip(ks, ok) if not o))
        puts += [k for k, o in zip(ks, ok) if o]
        live += [k for k, o in zip(ks, ok) if o]
        if len(live) > LIVE:
            rm = rng.sample(live, min(len(live) - LIVE + rng.randint(0, 2), len(live)))
            for k in rm:
                live.remove(k)
            say("removing " + ",".join(rm))  # (from here the parent insists on neither answer for these)
            remove(rm)
            gone += rm
        if rng.random() < flush_rate:
            if flush():
                say("flushed " + ",".join(puts) + ";" + ",".join(gone))
                puts, gone = [], []
            else:
                say("flush failed")


class Book:
    """What the parent knows: chunks that must be there, chunks that must not, chunks that may be."""

    def __init__(self) -> None:
        self.must: set[str] = set()
        self.gone: set[str] = set()
        self.maybe: set[str] = set()  # removal reported, not yet flushed
        self.gc = 0  # reclamations the writer reported

    def note(self, line: str) -> None:
        what, _, rest = line.partition(" ")
        if what == "removing":
            ks = rest.split(",")
            self.maybe.update(ks)
            self.must.difference_update(ks)
        elif what == "gc":
            self.gc = max(self.gc, int(rest))
        elif what == "flushed":
            p, _, r = rest.partition(";")
            puts = [k for k in p.split(",") if k]
            rms = [k for k in r.split(",") if k]
            self.must.update(k for k in puts if k not in self.maybe)
            self.must.difference_update(rms)
            self.maybe.difference_update(rms)
            self.gone.update(rms)
        else:
            raise AssertionError(f"the writer said {line!r}")


def _check(path: str, mode: str, book: Book, gen: int, seed: int) -> list:
    """Reopen and check everything; returns the live keys for the next writer."""
    where = f"(mode {mode}, round {gen}, seed {seed})"
    t = _open_tier(path, mode, False)
    try:
        found = dict(t.recover())
        lost = book.must - set(found)
        assert not lost, f"{len(lost)} flushed chunks lost, e.g. {sorted(lost)[:3]} {where}"
        back = book.gone & set(found)
        assert not back, f"{len(back)} removed chunks back, e.g. {sorted(back)[:3]} {where}"
        keys = sorted(found)
        outs = [torch.zeros(found[k], dtype=torch.uint8) for k in keys]
        ok = t.read(keys, [[o] for o in outs])
        for k, f, o in zip(keys, ok, outs):
            assert found[k] == len(value(k)), f"{k}: {found[k]} bytes, not {len(value(k))} {where}"
            if f:
                assert np.array_equal(o.numpy(), value(k)), f"wrong bytes for {k} {where}"
            else:
                assert k not in book.must, f"flushed chunk {k} unreadable {where}"
        probes = [name(0xFFFFFFF0, gen * 16 + j) for j in range(12)]
        got = t.write(probes, [[torch.from_numpy(value(k).copy())] for k in probes])
        assert got == [True] * len(probes), f"the reopened tier refused writes: {t.extra_stats()} {where}"
        t.delete(probes)
        on_disk = sum(os.path.getsize(os.path.join(path, "regions", f))
                      for f in os.listdir(os.path.join(path, "regions")))
        bound = t.regions_needed() * t.region_size
        assert on_disk <= bound, f"{on_disk} bytes of regions on disk, bound {bound} {where}"
        stats = t.extra_stats()
        assert stats["enospc"] == 0 and stats["io_errors"] == 0, f"{stats} {where}"
        return [k for k, f in zip(keys, ok) if f]
    finally:
        t.close()


@pytest.mark.slow
def test_a_writer_killed_at_random_points_loses_nothing_flushed(tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "tierkv", "tierkv.tiers.ssd", __name__])
    base = random.Random(20261203)
    kills = gc_runs = 0
    for mode in MODES:
        path = str(tmp_path / mode)
        book = Book()
        live: list = []
        for gen in range(1, ROUNDS + 1):
            seed = base.randrange(1 << 30)
            rng = random.Random(seed)
            store = gen % 3 == 0
            rx, tx = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(path, mode, store, seed, gen, live, tx), daemon=True)
            p.start()
            tx.close()
            try:
                assert rx.poll(120) and rx.recv_bytes() == b"ready", f"writer did not start (mode {mode}, seed {seed})"
                # a random report (in half the rounds the first to third reclamation's), then a random moment
                lines, gcs = rng.randint(1, 40), rng.choice([None, 1, 2, 3])
                while lines if gcs is None else gcs:
                    if not rx.poll(60):
                        raise AssertionError(f"writer went quiet (mode {mode}, round {gen}, seed {seed})")
                    line = rx.recv_bytes().decode()
                    book.note(line)
                    lines -= 1
                    if gcs is not None and line.startswith("gc "):
                        gcs -= 1
                time.sleep(rng.uniform(0, 0.02))  # on purpose: the kill lands anywhere in what follows the lines
            finally:
                os.kill(p.pid, signal.SIGKILL)
                p.join()
            while rx.poll():  # reports that left before the kill still count
                try:
                    book.note(rx.recv_bytes().decode())
                except (EOFError, OSError):
                    break
            rx.close()
            kills += 1
            live = _check(path, mode, book, gen, seed)
            # settled: what the reopen found was checkpointed at its close, and a removal that had not been
            # flushed either went or came back
            book.must, book.maybe = set(live), set()
            book.gone.difference_update(live)
            gc_runs += book.gc
            book.gc = 0
    assert kills >= 50
    assert gc_runs >= 20, f"reclamation ran only {gc_runs} times: the kills did not land among reclamations"


def _remover(path: str, conn) -> None:
    """Fill most of the tier, flush, remove half, write as much again into the room the removal made, then
    report and wait to be killed (nothing flushed after the removal)."""
    t = _open_tier(path, "buffered", False)
    t.recover()
    first = [name(1, n) for n in range(80)]
    assert all(t.write(first, [[torch.from_numpy(_big(k))] for k in first]))
    t.flush()
    t.delete(first[:40])
    second = [name(2, n) for n in range(40)]
    ok = t.write(second, [[torch.from_numpy(_big(k))] for k in second])
    conn.send_bytes(b"done " + bytes(str(sum(ok)), "ascii"))
    time.sleep(600)


def _big(k: str) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(int(k, 16) % (1 << 63)).bytes(64 << 10), dtype=np.uint8).copy()


def test_a_removal_is_not_undone_by_a_kill_after_writes_took_its_room(tmp_path):
    """A removal is in the dead log's file when ``delete`` returns (as a write is in its region's file): a
    writer killed before its next flush neither brings the removed objects back nor, because the writes made
    after the removal took their room, has its reopen drop flushed objects to get under capacity."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "tierkv", "tierkv.tiers.ssd", __name__])
    path = str(tmp_path / "d")
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_remover, args=(path, tx), daemon=True)
    p.start()
    tx.close()
    try:
        assert rx.poll(120), "the writer did not report"
        assert rx.recv_bytes() == b"done 40"
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    t = _open_tier(path, "buffered", False)
    try:
        found = dict(t.recover())
        first = [name(1, n) for n in range(80)]
        assert not set(first[:40]) & set(found), "removed objects came back"
        assert set(first[40:]) <= set(found), "flushed objects lost"
        assert t.extra_stats()["trimmed"] == 0
        keys = first[40:]
        outs = [torch.zeros(64 << 10, dtype=torch.uint8) for _ in keys]
        assert all(t.read(keys, [[o] for o in outs]))
        assert all(np.array_equal(o.numpy(), _big(k)) for k, o in zip(keys, outs))
    finally:
        t.close()
