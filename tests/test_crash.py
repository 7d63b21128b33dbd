"""A process SIGKILLed in the middle of SSD writes leaves intact chunks or misses, never a torn one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from tierkv import TieredStore

CHILD = textwrap.dedent("""
    import sys, torch
    from tierkv import TieredStore
    path, flushed_n = sys.argv[1], int(sys.argv[2])
    cfg = {"tiers": [{"medium": "ssd", "path": path, "capacity": "512MiB"}]}
    store = TieredStore.from_config(cfg)
    def val(i):
        return torch.full((1 << 20,), i % 251, dtype=torch.uint8)
    store.put([f"c{i:05d}" for i in range(flushed_n)], [val(i) for i in range(flushed_n)])
    store.flush()
    print("flushed", flush=True)
    i, rounds = flushed_n, 0
    while True:  # keep writing until killed, over a ring of keys well inside the capacity
        if i >= flushed_n + 300:
            i = flushed_n
        names = [f"c{i:05d}", f"c{i+1:05d}"]
        store.remove(names)
        store.put(names, [val(i), val(i + 1)])
        i += 2
        rounds += 1
        if rounds == 32:  # well into unflushed writes: the parent may kill from now on, mid-write
            print("writing", flush=True)
""")


def test_sigkill_mid_write_leaves_no_torn_chunk(tmp_path):
    path = str(tmp_path / "ssd")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, "20"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "flushed"
        assert proc.stdout.readline().strip() == "writing"  # the kill lands while it keeps writing
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with TieredStore.from_config({"tiers": [{"medium": "ssd", "path": path, "capacity": "512MiB"}]}) as store:
        names = [f"c{i:05d}" for i in range(320)]
        where = store.locate(names)
        present = [i for i, w in enumerate(where) if w]
        assert set(range(20)) <= set(present), "a flushed chunk was lost"
        assert len(present) > 20, "the child wrote nothing after its flush"
        outs = [torch.empty(1 << 20, dtype=torch.uint8) for _ in present]
        found = store.get([names[i] for i in present], outs)
        for i, f, o in zip(present, found, outs):
            if f:
                assert torch.equal(o, torch.full((1 << 20,), i % 251, dtype=torch.uint8)), f"torn chunk {i}"
        assert all(found[: 20])
        leftovers = [f for _, _, fs in os.walk(path) for f in fs if f.startswith(".tmp.")]
        assert not leftovers, "temp files survived the sweep"
