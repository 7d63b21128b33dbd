"""The connector's worker side when its process goes down: signals, the exit watcher, lookup sockets.

No engine: each scenario runs a small script in a process of its own (signals,
exits and orphans are process-wide), over a real SSD store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tierkv import TieredStore
from tierkv.adapters.vllm import lookup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a new interpreter; its output is read to the end (orphans that inherit it too)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


_WORKER = """
    import json, os, signal, sys, threading, time, torch
    from tierkv import TieredStore
    from tierkv.adapters.vllm import lifecycle
    from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
    from tierkv.adapters.vllm.metadata import SaveSpec, TierKVConnectorMetadata
    from tierkv.adapters.vllm.worker import TierKVWorker

    gate = threading.Event()

    class GatedPuts:
        '''The real store, each put held until ``gate`` opens: saves are still queued when the signal comes.'''
        def __init__(self, store): self._store = store
        def __getattr__(self, name): return getattr(self._store, name)
        def put_detailed(self, keys, values, tenant=None):
            assert gate.wait(60), "the gate never opened"
            return self._store.put_detailed(keys, values, tenant=tenant)

    store = TieredStore.from_config({"tiers": [{"medium": "ssd", "path": sys.argv[1], "capacity": "64MiB"}]})
    layers = ("l0", "l1")
    info = EngineInfo(block_size=16, layers=layers, num_blocks=8, shard=kv_shard(0, 1, 2), namespaces={0: "ns"})
    opts = ConnectorOptions(chunk_tokens=16, save_wait=False)
    worker = TierKVWorker(opts, info, GatedPuts(store), serve=False)
    worker.register_kv_caches({n: torch.randn(8, 2, 16, 8) for n in layers})
    # one request of 3 blocks, one object per block
    spec = SaveSpec("r1", [(0, 0), (1, 1), (2, 2)], [[3], [4], [5]], [bytes([i]) * 32 for i in range(3)], [3, 4, 5])
    worker.bind_metadata(TierKVConnectorMetadata(saves=[spec]))
"""


@pytest.mark.vllm
def test_signal_drains_queued_saves_then_runs_the_engines_handler(tmp_path):
    """SIGTERM in an engine process: the worker drains its queued saves into the store, flushes and
    closes it, and then the engine's own handler (here: vLLM's, which raises SystemExit) runs."""
    ssd = tmp_path / "ssd"
    out = _run((_WORKER + """
    def engines_handler(signum, frame):  # what vLLM's worker process installs
        raise SystemExit(7)
    signal.signal(signal.SIGTERM, engines_handler)
    assert lifecycle.on_engine_signal(worker.shutdown)
    chained = signal.getsignal(signal.SIGTERM)
    def open_gate_then_chain(signum, frame):  # the signal opens the store's gate, then the drain runs
        gate.set()
        chained(signum, frame)
    signal.signal(signal.SIGTERM, open_gate_then_chain)
    for n in layers:
        worker.save_kv_layer(n)
    assert worker.pending_saves() == 2  # one put per layer, held at the closed gate until the signal
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises SystemExit right here; the sleep only bounds a handler that does not
        print("no SystemExit")
    except SystemExit as e:
        print("RESULT " + json.dumps({"code": e.code, "closed": worker.closed, "store_closed": store.closed,
                                      "pending": worker.pending_saves(), "saved": worker.totals.data["save_blocks"]}))
    """).replace("sys.argv[1]", repr(str(ssd))))
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stdout + out.stderr
    r = json.loads(line[0][7:])
    assert r == {"code": 7, "closed": True, "store_closed": True, "pending": 0, "saved": 6}
    # durable: a new process finds every object (3 blocks x 2 layers)
    with TieredStore.from_config({"tiers": [{"medium": "ssd", "path": str(ssd), "capacity": "64MiB"}]}) as s:
        assert s.stats()["ssd"]["entries"] == 6


def test_default_handlers_are_left_alone(tmp_path):
    """Outside an engine process (Python's own handlers) the connector installs nothing."""
    out = _run("""
    import signal
    from tierkv.adapters.vllm import lifecycle
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    print(lifecycle.on_engine_signal(lambda: None), before == (signal.getsignal(signal.SIGINT),
                                                              signal.getsignal(signal.SIGTERM)))
    """)
    assert out.stdout.split() == ["False", "True"], out.stderr


@pytest.mark.parametrize("ending", ["killed", "logged", "clean"])
def test_watcher_reports_a_worker_that_died_before_its_shutdown(tmp_path, ending):
    """The watcher outlives its worker: a worker killed before its shutdown gets its totals line and its
    file socket removed; one that printed its totals, or shut down, gets nothing more."""
    sock = tmp_path / "tierkv-test-0.sock"
    sock.write_text("")
    out = _run(f"""
    import os
    from tierkv.adapters.vllm import lifecycle
    w = lifecycle.Watcher.get()
    report = w.watch("w1", ["\\0tierkv-abstract.sock", {str(sock)!r}])
    report("totals", {{"saved_blocks": 5}})
    report("totals", {{"saved_blocks": 9}})
    if {ending!r} != "killed":
        report({ending!r})
    os._exit(0)  # no shutdown, no atexit: as SIGKILL leaves it
    """)
    lines = [x for x in out.stdout.splitlines() if "TierKVConnector totals" in x]
    if ending == "killed":  # the latest totals, once
        assert len(lines) == 1 and "{'saved_blocks': 9}" in lines[0], out
        assert "ended before its connector shut down" in lines[0]
    else:
        assert lines == [], out.stdout
    # a worker that died mid-shutdown leaves its socket to the watcher; a clean one removed its own
    assert sock.exists() == (ending == "clean")


def test_a_report_from_a_signal_handler_gets_through_while_the_thread_was_inside_send(tmp_path):
    """The worker's shutdown runs in a signal handler on the engine's thread, which may have been inside
    ``send`` (its totals, every step): the handler's own ``logged`` still reaches the watcher, and nothing
    waits on itself.  (Sending under the watcher's lock, this hung until the engine's SIGKILL, and the
    watcher then printed a second totals line.)"""
    out = _run("""
    import os, signal
    from tierkv.adapters.vllm import lifecycle
    w = lifecycle.Watcher.get()
    report = w.watch("w1", [])
    report("totals", {"saved_blocks": 7})
    signal.signal(signal.SIGUSR1, lambda s, f: report("logged"))
    import contextlib
    # as inside send() when the signal lands: holding whatever send holds (a lock, once; nothing now)
    with getattr(w, "_lock", None) or contextlib.nullcontext():
        signal.raise_signal(signal.SIGUSR1)  # the handler runs here, on this thread
        report("totals", {"saved_blocks": 8})
    print("sent", flush=True)
    os._exit(0)  # killed right after the handler: the watcher must not print the totals again
    """, timeout=60)
    assert "sent" in out.stdout, out.stderr
    assert [x for x in out.stdout.splitlines() if "TierKVConnector totals" in x] == [], out.stdout


def test_watcher_lines_stay_whole_between_threads(tmp_path):
    """Reports from several threads at once reach the watcher whole (one write each, no lock): the last
    totals of a killed worker are printed once, as sent; a report too long for one write goes without its
    payload."""
    out = _run("""
    import os, threading
    from tierkv.adapters.vllm import lifecycle
    w = lifecycle.Watcher.get()
    report = w.watch("w1", [])
    def hammer(i):
        for j in range(300):
            report("totals", {"thread": i, "n": j, "pad": "x" * 200})
    ts = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    report("totals", {"saved_blocks": 42})
    w.watch("w2", [])("totals", {"pad": "y" * 8192})
    os._exit(0)
    """, timeout=60)
    lines = {x.split("(worker ")[1].split(",")[0]: x for x in out.stdout.splitlines() if "TierKVConnector totals" in x}
    assert sorted(lines) == ["w1", "w2"], out.stdout
    assert "{'saved_blocks': 42}" in lines["w1"] and "{'over_pipe_buf': " in lines["w2"], lines


def _unix_sockets() -> str:
    with open("/proc/net/unix") as f:
        return f.read()


def _bind_and_abandon(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # the file stays, nobody listens: what a killed worker leaves


def test_stale_file_sockets_are_swept_and_live_ones_kept(tmp_path):
    stale = str(tmp_path / "tierkv-aaaa-0.sock")
    live = str(tmp_path / "tierkv-bbbb-0.sock")
    other = str(tmp_path / "unrelated.sock")
    _bind_and_abandon(stale)
    _bind_and_abandon(other)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(live)
    srv.listen(1)
    try:
        assert lookup.sweep_stale_sockets(str(tmp_path)) == [stale]
        assert not os.path.exists(stale) and os.path.exists(live) and os.path.exists(other)
    finally:
        srv.close()


@pytest.mark.skipif(not lookup.ABSTRACT, reason="abstract Unix sockets are Linux-only")
def test_lookup_socket_leaves_no_file_and_answers_other_processes(tmp_path):
    """A channel answers its one request type from another process, names any other type in its error,
    and leaves no file; each channel of a worker has an address of its own."""
    from tierkv.adapters.vllm.service import Channel, ProbeAnswer

    path, key = lookup.endpoint("engine-under-test", 0, 0)
    life, _ = lookup.endpoint("engine-under-test", 0, 0, Channel.LIFECYCLE)
    assert path.startswith("\0") and "tierkv-" in path and life != path and life.startswith("\0")
    srv = lookup.ChannelServer(path, key, Channel.LOOKUP, lambda req: ProbeAnswer(len(req.hashes), req.local))
    try:
        out = _run(f"""
        from multiprocessing.connection import Client
        from tierkv.adapters.vllm.service import ProbeRequest, ShutdownRequest
        c = Client({path!r}, family="AF_UNIX", authkey={key!r})
        c.send(ProbeRequest([b"a", b"b"], 1))
        print(c.recv())
        c.send(ShutdownRequest())
        print(c.recv())
        """, timeout=60)
        lines = out.stdout.strip().splitlines()
        assert lines[0] == "('ok', ProbeAnswer(reach=2, held=1, where=[], leased=0, missed={}))", out.stderr
        assert lines[1].startswith("('error',") and "takes a ProbeRequest, got ShutdownRequest" in lines[1]
        assert not any(n.startswith("tierkv-") and "engine" in n for n in os.listdir(tmp_path))
        assert "@" + path[1:] in _unix_sockets()
    finally:
        srv.close()
    assert "@" + path[1:] not in _unix_sockets()  # the name is gone with the server
