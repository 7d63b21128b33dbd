"""Persistence semantics: a persistent tier receives every chunk its admission policy accepts.

``persist``: ``write_behind`` (default for persistent media: a background copy that
never blocks the caller), ``write_through`` (synchronous), ``on_evict`` (demotions only).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from fake_media import FakeTier

from tierkv import Level, TieredStore
from tierkv.tiers.dram import DRAMTier

CHUNK = 16 << 10


def chunk(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=g)


def keys_for(n: int, ns: str = "p") -> list[str]:
    return [f"{ns}-{i:05d}" for i in range(n)]


def chain(path, persist=None, dram_chunks=64, ssd_chunks=256):
    ssd = {"medium": "ssd", "path": str(path), "capacity": ssd_chunks * (CHUNK + 8192)}
    if persist is not None:
        ssd["persist"] = persist
    return {"tiers": [{"medium": "dram", "capacity": dram_chunks * CHUNK, "prefault": False}, ssd],
            "promotion": "never"}


def ssd_only(path, ssd_chunks=256):
    return {"tiers": [{"medium": "ssd", "path": str(path), "capacity": ssd_chunks * (CHUNK + 8192)}]}


def read_all(store, keys):
    outs = [torch.empty(CHUNK, dtype=torch.uint8) for _ in keys]
    found = store.get(keys, outs)
    return [i for i, (f, o) in enumerate(zip(found, outs)) if f and torch.equal(o, chunk(i))]


def test_write_behind_is_the_default_for_persistent_media(tmp_path):
    with TieredStore.from_config(chain(tmp_path / "ssd")) as store:
        info = {t["name"]: t for t in store.tier_info()}
        assert info["ssd"]["persist"] == "write_behind"
        assert info["dram"]["persist"] == "on_evict"


def test_clean_close_reopens_with_every_chunk_on_ssd(tmp_path):
    keys = keys_for(40)
    with TieredStore.from_config(chain(tmp_path / "ssd")) as store:
        assert store.put(keys, [chunk(i) for i in range(40)]) == [True] * 40
        assert store.locate(keys) == ["dram"] * 40  # everything fits in DRAM; SSD copies come behind
    with TieredStore.from_config(ssd_only(tmp_path / "ssd")) as store:
        assert store.locate(keys) == ["ssd"] * 40
        assert read_all(store, keys) == list(range(40))


def test_flush_makes_the_copies_and_counts_them(tmp_path):
    keys = keys_for(20)
    with TieredStore.from_config(chain(tmp_path / "ssd")) as store:
        store.put(keys, [chunk(i) for i in range(20)])
        assert store.flush()  # true: everything durable
        s = store.stats()
        assert s["ssd"]["persisted"] == 20 and s["ssd"]["entries"] == 20
        assert s["total"]["write_behind_queued"] == 20 and s["total"]["write_behind_pending"] == 0
        assert s["dram"]["entries"] == 20  # the fast copy stays where it was stored


def test_on_evict_keeps_the_old_behaviour(tmp_path):
    keys = keys_for(10)
    with TieredStore.from_config(chain(tmp_path / "ssd", persist="on_evict")) as store:
        store.put(keys, [chunk(i) for i in range(10)])
    with TieredStore.from_config(ssd_only(tmp_path / "ssd")) as store:
        assert store.lookup(keys) == 0  # nothing was evicted, so nothing reached the SSD


def test_write_through_copies_before_put_returns(tmp_path):
    keys = keys_for(10)
    with TieredStore.from_config(chain(tmp_path / "ssd", persist="write_through")) as store:
        store.put(keys, [chunk(i) for i in range(10)])
        assert store.stats()["ssd"]["entries"] == 10  # no background queue involved
        assert store.stats()["total"]["write_behind_queued"] == 0


def test_admission_of_the_persistent_tier_is_honoured(tmp_path):
    cfg = chain(tmp_path / "ssd")
    cfg["tiers"][1]["admission"] = {"policy": "size", "max_bytes": CHUNK - 1}
    with TieredStore.from_config(cfg) as store:
        store.put(keys_for(5), [chunk(i) for i in range(5)])
        store.flush()
        assert store.stats()["ssd"]["entries"] == 0


def test_a_full_queue_drops_and_counts_never_blocks_the_caller():
    slow = FakeTier("slow", 64 * CHUNK, persistent=True)  # a device that cannot keep up: writes wait
    slow.gate.clear()
    store = TieredStore([Level(DRAMTier("fast", 64 * CHUNK, prefault=False)), Level(slow)],
                        write_behind_queue=4)
    keys = keys_for(30)
    done = threading.Event()

    def produce():
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    assert done.wait(20), "put blocked behind the write-behind queue"
    s = store.stats()["total"]
    assert s["write_behind_dropped"] > 0
    assert s["write_behind_queued"] + s["write_behind_dropped"] == 30
    slow.gate.set()
    assert store.drain_write_behind(timeout=30)
    assert store.stats()["slow"]["entries"] == s["write_behind_queued"]
    res = store.flush()  # (the copies given up are queued again: those the queue takes land)
    assert store.stats()["slow"]["entries"] + res.not_durable == 30
    t.join()
    store.close()


CHILD = textwrap.dedent("""
    import os, sys, torch
    from tierkv import TieredStore
    sys.path.insert(0, {testdir!r})
    from test_persistence import chain, chunk, keys_for
    store = TieredStore.from_config(chain({path!r}))
    keys = keys_for(60)
    store.put(keys[:30], [chunk(i) for i in range(30)])
    store.flush()
    print("flushed", flush=True)
    store.put(keys[30:], [chunk(i) for i in range(30, 60)])
    os.kill(os.getpid(), 9)
""")



def run_killed_child(template: str, path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``template`` (formatted with ``testdir`` and ``path``) in a new interpreter that ends by killing
    itself with SIGKILL (its last line); returns the finished process, checked to have died that way."""
    code = template.format(testdir=os.path.dirname(__file__), path=str(path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    return p

@pytest.mark.slow
def test_sigkill_keeps_everything_before_the_last_flush(tmp_path):
    p = run_killed_child(CHILD, tmp_path / "ssd", timeout=120)
    assert "flushed" in p.stdout
    keys = keys_for(60)
    with TieredStore.from_config(ssd_only(tmp_path / "ssd")) as store:
        got = set(read_all(store, keys))
        assert set(range(30)) <= got  # everything before the flush; later ones may or may not be there
        for i, k in enumerate(keys):
            out = torch.empty(CHUNK, dtype=torch.uint8)
            if store.get([k], [out]) == [True]:
                assert torch.equal(out, chunk(i)), "a wrong byte after SIGKILL"


class _OneSlowCopy(FakeTier):
    """A persistent fake whose first write of ``"first"`` waits on ``gate`` (and then fails, if asked);
    every other write, demotions included, goes straight through."""

    def __init__(self, fail: bool) -> None:
        super().__init__("slow", 256 * CHUNK, persistent=True)
        self.gate_writes = False
        self.gate.clear()
        self.fail_once = fail

    def _write(self, keys, srcs):
        if "first" in keys and not self.entered.is_set():
            self._wait()
            if self.fail_once:
                raise OSError("fake medium: write failed")
        return super()._write(keys, srcs)


@pytest.mark.parametrize("fail", [False, True])
def test_a_chunk_in_a_write_behind_copy_is_never_in_no_tier(fail):
    """The source of a write-behind copy stays pinned above until the copy lands (or fails): the
    level above keeps taking puts meanwhile, and the chunk is readable throughout and after."""
    slow = _OneSlowCopy(fail)
    store = TieredStore([Level(DRAMTier("fast", 16 * CHUNK, prefault=False)), Level(slow)], promotion="never")
    out = torch.empty(CHUNK, dtype=torch.uint8)
    try:
        store.put(["first"], [chunk(0)])
        assert slow.entered.wait(10), "the write-behind copy never started"
        for i, k in enumerate(keys_for(40)):  # fill the fast tier far past its capacity
            assert store.put([k], [chunk(i + 1)]) == [True], "the copy held up the tier above"
            assert store.lookup(["first"]) == 1, "the chunk being copied vanished from every tier"
        assert store.get(["first"], [out]) == [True] and torch.equal(out, chunk(0))
        assert store.locate(["first"])[0] == "fast"  # pinned above while its copy is in flight
    finally:
        slow.gate.set()
        assert store.drain_write_behind(timeout=30)
    for i, k in enumerate(keys_for(40, "later")):  # "first" is now unpinned: evicted, demoted below
        store.put([k], [chunk(i + 100)])
    assert store.get(["first"], [out]) == [True] and torch.equal(out, chunk(0))
    assert "first" in slow.data
    assert store.drain_write_behind(timeout=30)  # the later puts' own copies hold their pins until done
    for lvl in store.levels:
        assert not lvl.pinned, "a pin outlived the copy"
        assert not [k for k, e in lvl.items() if not e.ready], "a reservation leaked"
    store.close()


LEFT_OPEN = textwrap.dedent("""
    import atexit, json, sys, threading
    import torch
    # registered before tierkv is imported; atexit callbacks run after tierkv's own exit hook
    atexit.register(lambda: print("ALIVE", json.dumps(sorted(
        t.name for t in threading.enumerate() if t.name.startswith("tierkv"))), flush=True))
    from tierkv import TieredStore
    tiers = [{{"medium": "ssd", "path": {path!r}, "capacity": "256MiB"}}]
    if {over_dram!r}:
        tiers.insert(0, {{"medium": "dram", "capacity": "256MiB", "prefault": False}})
    store = TieredStore.from_config({{"tiers": tiers, "promotion": "never"}})
    keys = ["big-%03d" % i for i in range(80)]
    ok = store.put(keys, [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(80)])
    print("put", ok == [True] * 80, flush=True)
    {ending}
""")

ENDINGS = {"end of script": "pass", "sys.exit": "sys.exit(0)", "uncaught exception": "raise RuntimeError('left')"}


@pytest.mark.slow
@pytest.mark.parametrize("over_dram", [True, False], ids=["dram-over-ssd", "ssd-only"])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_store_left_open_at_exit_is_closed_and_its_copies_kept(request, tmp_path, ending, over_dram):
    """No close, no flush: however the program ends, the exit closes the store as close() would (every
    write-behind copy made, the ssd's checkpoint written, nothing said about a failure, no thread of the
    store left running while the interpreter finalizes).  80 chunks of 1 MiB: the write-behind queue is
    far from drained when the script ends."""
    if over_dram and (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3):
        # (the copies below need the ssd tier's write pool to start threads: docs/architecture.md)
        request.applymarker(pytest.mark.xfail(strict=True, reason="CPython 3.12.0 to 3.12.2 start no thread at exit"))
    path = str(tmp_path / "ssd")
    code = LEFT_OPEN.format(path=path, over_dram=over_dram, ending=ENDINGS[ending])
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == (1 if ending == "uncaught exception" else 0), p.stderr[-2000:]
    assert "put True" in p.stdout
    assert "ALIVE []" in p.stdout, p.stdout
    assert "fail" not in p.stderr.lower(), p.stderr[-2000:]
    with TieredStore.from_config({"tiers": [{"medium": "ssd", "path": path, "capacity": "256MiB"}]}) as store:
        assert store.stats()["ssd"]["recovered_from"] == "checkpoint"  # (closed, not recovered from a crash)
        keys = [f"big-{i:03d}" for i in range(80)]
        outs = [torch.empty(1 << 20, dtype=torch.uint8) for _ in keys]
        assert store.get(keys, outs) == [True] * 80
        assert all(bool((o == i).all()) for i, o in enumerate(outs))


TERMINATED = """
from tierkv.shutdown import close_on_terminate
print("installed", close_on_terminate(), flush=True)
print("ready", flush=True)
sys.stdin.readline()  # until the test's SIGTERM ends the process
"""


@pytest.mark.slow
@pytest.mark.parametrize("over_dram", [True, False], ids=["dram-over-ssd", "ssd-only"])
def test_a_sigterm_under_the_default_disposition_closes_the_store_first(tmp_path, over_dram):
    """close_on_terminate(): where SIGTERM would end the process at once (an engine's worker process under
    Python's default disposition), the stores are closed first, then the signal ends the process as before."""
    path = str(tmp_path / "ssd")
    code = LEFT_OPEN.format(path=path, over_dram=over_dram, ending="") + TERMINATED
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "ready":  # the handshake: the puts are done and the handler is in place
            line = p.stdout.readline()
            assert line, p.stderr.read()[-2000:]
            lines.append(line.strip())
        assert "put True" in lines and "installed True" in lines, lines
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGTERM, err[-2000:]  # still ended by the signal
    assert "closing the stores still open" in err
    with TieredStore.from_config({"tiers": [{"medium": "ssd", "path": path, "capacity": "256MiB"}]}) as store:
        assert store.stats()["ssd"]["recovered_from"] == "checkpoint"  # closed, not recovered from a crash
        keys = [f"big-{i:03d}" for i in range(80)]
        outs = [torch.empty(1 << 20, dtype=torch.uint8) for _ in keys]
        assert store.get(keys, outs) == [True] * 80
        assert all(bool((o == i).all()) for i, o in enumerate(outs))


def test_close_on_terminate_leaves_a_handler_the_program_set_alone():
    code = textwrap.dedent("""
        import signal
        signal.signal(signal.SIGTERM, lambda *a: None)
        from tierkv.shutdown import close_on_terminate
        print(close_on_terminate())
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr


FORKS = textwrap.dedent("""
    import os, sys
    from tierkv import TieredStore
    sys.path.insert(0, {testdir!r})
    from test_persistence import chain, chunk, keys_for
    store = TieredStore.from_config(chain({path!r}))
    keys = keys_for(40)
    assert store.put(keys[:20], [chunk(i) for i in range(20)]) == [True] * 20
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a child that exits normally: its exit callbacks run, on its copy of the parent's store
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    assert store.put(keys[20:], [chunk(i) for i in range(20, 40)]) == [True] * 20
    store.close()
""")


@pytest.mark.slow
def test_a_forked_child_leaves_its_parents_store_alone_at_exit(tmp_path):
    code = FORKS.format(testdir=os.path.dirname(__file__), path=str(tmp_path / "ssd"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "child 0" in p.stdout
    with TieredStore.from_config(ssd_only(tmp_path / "ssd")) as store:
        assert read_all(store, keys_for(40)) == list(range(40))
