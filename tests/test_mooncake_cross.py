"""Cross-instance reuse: two engine processes with no shared Python state share chunks through the pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from mooncake_util import MooncakeMaster, missing_reason

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
        # A keeps only a sliver locally, so nearly everything it stores lives in the pool
        cfg_a = {"tiers": [{"medium": "dram", "capacity": "256KiB"}, pool]}
        cfg_b = {"tiers": [{"medium": "dram", "capacity": "8MiB"}, pool]}
        a = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(cfg_a), str(n)], cwd=HERE,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = a.stdout.readline()
            assert line, "writer process died"
            wrote = json.loads(line)
            assert wrote["put"] == [True] * n
            # a chunk evicted from A's DRAM lives on only in the pool (the store writes the pool directly too)
            assert all(w in ("dram", "dram_pool") for w in wrote["where"])
            b = subprocess.run([sys.executable, "-c", READER, json.dumps(cfg_b), str(n)], cwd=HERE,
                               capture_output=True, text=True, timeout=120)
            assert b.returncode == 0, b.stderr[-3000:]
            res = json.loads(b.stdout.strip().splitlines()[-1])
        finally:
            if a.poll() is None:
                a.stdin.close()
                try:
                    a.wait(30)
                except subprocess.TimeoutExpired:
                    a.kill()
                    a.wait(10)
        pool_only = sum(1 for w in wrote["where"] if w == "dram_pool")
        assert pool_only >= 1
        # B sees every chunk that reached the pool (all but those A kept only locally)
        in_pool = [i for i, w in enumerate(wrote["where"]) if w == "dram_pool"]
        assert res["lookup"] >= 1, (wrote, res)
        for i in in_pool:
            assert res["get"][i] and res["exact"][i], res
        assert all(e for g_, e in zip(res["get"], res["exact"]) if g_), "a hit with wrong bytes"
        assert res["absent"] == 0
