"""Cross-instance reuse: two engine processes with no shared Python state share chunks through the pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from mooncake_util import Holder, MooncakeMaster, missing_reason

pytestmark = [pytest.mark.mooncake, pytest.mark.slow,
              pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]

HERE = os.path.dirname(os.path.abspath(__file__))

# Process A: a TieredStore (small local DRAM tier above the pool) stores chunks, then holds its segment.
WRITER = r"""
import json, sys, torch
from tierkv.store import TieredStore
cfg, n = json.loads(sys.argv[1]), int(sys.argv[2])
store = TieredStore.from_config(cfg)
keys = [f"{i:064x}" for i in range(1, n + 1)]
g = torch.Generator().manual_seed(1234)
# multi-part chunks (one part per "layer"), as an engine hands them over
vals = [[torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=g) for _ in range(4)] for _ in keys]
ok = store.put(keys, vals)
print(json.dumps({"put": ok, "where": store.locate(keys)}), flush=True)
sys.stdin.read()
store.close()
"""

# Process C: reads (a read from the pool is promoted into the local tier in the background) and exits
# without closing its store.  Its last exit callback names every tierkv thread still alive.
LEAVER = r"""
import atexit, json, sys, threading
atexit.register(lambda: print("ALIVE", json.dumps(sorted(
    t.name for t in threading.enumerate() if t.name.startswith("tierkv"))), flush=True))
import torch
from tierkv.store import TieredStore
cfg, n = json.loads(sys.argv[1]), int(sys.argv[2])
store = TieredStore.from_config(cfg)
keys = [f"{i:064x}" for i in range(1, n + 1)]
outs = [torch.zeros(256 << 10, dtype=torch.uint8) for _ in keys]
print("get", json.dumps(store.get(keys, outs)), flush=True)
"""

# Process B: another engine instance finds them with lookup and reads exact bytes.
READER = r"""
import json, sys, torch
from tierkv.store import TieredStore
cfg, n = json.loads(sys.argv[1]), int(sys.argv[2])
store = TieredStore.from_config(cfg)
keys = [f"{i:064x}" for i in range(1, n + 1)]
g = torch.Generator().manual_seed(1234)
want = [torch.cat([torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=g) for _ in range(4)])
        for _ in keys]
found = store.lookup(keys)
outs = [torch.zeros(256 << 10, dtype=torch.uint8) for _ in keys]
got = store.get(keys, outs)
exact = [bool(g_ and torch.equal(o, w)) for g_, o, w in zip(got, outs, want)]
absent = store.lookup([f"{0xdead:064x}"])
print(json.dumps({"lookup": found, "get": got, "exact": exact, "absent": absent}), flush=True)
store.close()
"""


def test_process_b_finds_and_reads_what_process_a_stored():
    n = 12
    with MooncakeMaster() as m:
        pool = m.tier_config(segment="32MiB", namespace=f"cross-{uuid.uuid4().hex}")
        # A's local tier is too small for a chunk, so everything it stores goes to the pool
        cfg_a = {"tiers": [{"medium": "dram", "capacity": "64KiB"}, pool]}
        cfg_b = {"tiers": [{"medium": "dram", "capacity": "8MiB"}, pool]}
        with Holder([sys.executable, "-c", WRITER, json.dumps(cfg_a), str(n)], cwd=HERE) as a:
            assert a.line, "writer process died"
            wrote = json.loads(a.line)
            assert wrote["put"] == [True] * n
            assert wrote["where"] == ["dram_pool"] * n
            b = subprocess.run([sys.executable, "-c", READER, json.dumps(cfg_b), str(n)], cwd=HERE,
                               capture_output=True, text=True, timeout=120)
            assert b.returncode == 0, b.stderr[-3000:]
            res = json.loads(b.stdout.strip().splitlines()[-1])
        assert res["lookup"] == n, res
        assert res["get"] == [True] * n and res["exact"] == [True] * n, res
        assert res["absent"] == 0


# same set-up as the test above (a pool, a writer holding it): the assertions that follow differ
def test_a_process_that_leaves_its_store_open_exits_cleanly():
    """The pool client, its workers and the store's copier are shut down before the interpreter
    finalizes: no tierkv thread is alive in the last exit callback, and the exit code is 0 (a
    worker caught by finalization used to abort the process after its work was done)."""
    n = 12
    with MooncakeMaster() as m:
        pool = m.tier_config(segment="32MiB", namespace=f"leave-{uuid.uuid4().hex}")
        cfg_a = {"tiers": [{"medium": "dram", "capacity": "64KiB"}, pool]}
        cfg_c = {"tiers": [{"medium": "dram", "capacity": "8MiB"}, pool]}
        with Holder([sys.executable, "-c", WRITER, json.dumps(cfg_a), str(n)], cwd=HERE) as a:
            assert a.line and json.loads(a.line)["put"] == [True] * n, "writer process died"
            for _ in range(3):
                c = subprocess.run([sys.executable, "-c", LEAVER, json.dumps(cfg_c), str(n)], cwd=HERE,
                                   capture_output=True, text=True, timeout=120)
                assert c.returncode == 0, c.stderr[-3000:]
                assert f"get {json.dumps([True] * n)}" in c.stdout, c.stdout
                assert "ALIVE []" in c.stdout, c.stdout
