"""Faults on a real Mooncake Store: master killed / hung / restarted, segment owner killed, pool full.

A fault costs misses, never an exception or wrong bytes; the store keeps serving
from its other tiers and the remote tier comes back by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from mooncake_util import MooncakeMaster, missing_reason, wait_for
from tier_conformance import blob

from tierkv.store import TieredStore
from tierkv.tiers.remote.media import DramPoolTier

pytestmark = [pytest.mark.mooncake, pytest.mark.slow,
              pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]

HERE = os.path.dirname(os.path.abspath(__file__))


def k(i: int, tag: str = "f") -> str:
    return f"{tag}{i:063x}"


def tier_opts(m: MooncakeMaster, **extra) -> dict:
    cfg = m.tier_config(segment="32MiB", namespace=uuid.uuid4().hex, **extra)
    cfg.pop("medium")
    return cfg


def test_master_killed_mid_run_then_restarted():
    with MooncakeMaster() as m:
        # a read into the caller's memory that outlives its deadline is waited for up to ``late_read_wait``
        # (its memory may still be written): a Mooncake get to a master just killed sometimes blocks ~4 s
        pool_cfg = m.tier_config(segment="32MiB", namespace=uuid.uuid4().hex, probe_interval=0.2,
                                 late_read_wait=0.5)
        cfg = {"tiers": [{"medium": "dram", "capacity": "1MiB"}, pool_cfg]}
        with TieredStore.from_config(cfg) as store:
            keys = [k(i) for i in range(16)]
            vals = [blob(i, 128 << 10) for i in range(16)]  # 2 MiB: half stays local, half only in the pool
            assert store.put(keys, vals) == [True] * 16
            where = store.locate(keys)
            local = [i for i, w in enumerate(where) if w == "dram"]
            remote_only = [i for i, w in enumerate(where) if w == "dram_pool"]
            assert local and remote_only, where

            m.kill()
            outs = [torch.zeros(128 << 10, dtype=torch.uint8) for _ in keys]
            for _round in range(3):  # the first call detects, the next ones answer at once
                t0 = time.monotonic()
                got = store.get(keys, outs)  # never raises
                # deadline: timeout + bytes/min_bandwidth, then at most late_read_wait; blocking takes 4.5 s+
                assert time.monotonic() - t0 < 2.0
                for i in local:
                    assert got[i] and torch.equal(outs[i], vals[i])
                for i in remote_only:
                    assert not got[i]
            st = store.stats()["dram_pool"]
            assert st["available"] is False and st["failures"] >= 1
            t0 = time.monotonic()
            assert store.lookup([keys[i] for i in remote_only]) == 0
            assert store.put([k(100)], [blob(100, 1000)]) == [True]  # the local tier still takes writes
            assert time.monotonic() - t0 < 2.0  # deadline: timeout + bytes/min_bandwidth; blocking takes 4.5 s+

            m.restart()
            t0 = time.monotonic()
            assert wait_for(lambda: store.stats()["dram_pool"]["available"], 15), store.stats()["dram_pool"]
            recovered_in = time.monotonic() - t0
            assert recovered_in < 15
            # the restarted master lost the pool: its keys are not claimed
            tier = store.levels[1].tier
            assert tier.contains([keys[i] for i in remote_only]) == [False] * len(remote_only)
            assert store.get([keys[remote_only[0]]], [outs[remote_only[0]]]) == [False]
            # and new chunks go to the pool again
            fresh = blob(7, 64 << 10)
            assert tier.write([k(200)], [[fresh]]) == [True]
            out = torch.zeros_like(fresh)
            assert tier.read([k(200)], [[out]]) == [True] and torch.equal(out, fresh)
            st = store.stats()["dram_pool"]
            assert st["reconnects"] >= 1 and st["pool_lost"] >= 1


def test_hung_master_costs_one_deadline_then_instant_misses():
    with MooncakeMaster() as m:
        tier = DramPoolTier.from_config("pool", tier_opts(m, timeout=0.3, probe_interval=0.2))
        try:
            v = blob(1, 4096)
            assert tier.write([k(1)], [[v]]) == [True]
            m.proc.send_signal(signal.SIGSTOP)
            try:
                out = torch.zeros(4096, dtype=torch.uint8)
                t0 = time.monotonic()
                assert tier.contains([k(2)]) == [False]  # not cached: must ask the (hung) master
                first = time.monotonic() - t0
                assert first < 2.0
                assert not tier.available
                t0 = time.monotonic()
                for _ in range(100):
                    assert tier.read([k(1)], [[out]]) == [False]
                    assert tier.write([k(3)], [[v]]) == [False]
                assert (time.monotonic() - t0) / 200 < 0.05
                assert tier.extra_stats()["timeouts"] >= 1
            finally:
                m.proc.send_signal(signal.SIGCONT)
            assert wait_for(lambda: tier.available, 20)
            assert tier.write([k(4)], [[v]]) == [True]
        finally:
            tier.close()


OWNER = r"""
import json, sys, torch
from tierkv.tiers.remote.media import DramPoolTier
opts, keys = json.loads(sys.argv[1]), json.loads(sys.argv[2])
tier = DramPoolTier.from_config("owner", opts)
g = torch.Generator().manual_seed(5)
vals = [torch.randint(0, 256, (2 << 20,), dtype=torch.uint8, generator=g) for _ in keys]
print(json.dumps(tier.write(keys, [[v] for v in vals])), flush=True)
sys.stdin.read()  # hold the segment until killed
"""


def test_segment_owner_killed_readers_miss():
    with MooncakeMaster() as m:
        opts = tier_opts(m, probe_interval=0.2)
        keys = [k(i, "o") for i in range(4)]
        owner = subprocess.Popen([sys.executable, "-c", OWNER, json.dumps(opts), json.dumps(keys)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)
        try:
            assert json.loads(owner.stdout.readline()) == [True] * 4
            # the reader joins after the writes: the objects live in the owner's segment
            reader = DramPoolTier.from_config("reader", dict(opts))
            try:
                g = torch.Generator().manual_seed(5)
                vals = [torch.randint(0, 256, (2 << 20,), dtype=torch.uint8, generator=g) for _ in keys]
                outs = [torch.zeros(2 << 20, dtype=torch.uint8) for _ in keys]
                assert reader.read(keys, [[o] for o in outs]) == [True] * 4
                assert all(torch.equal(o, v) for o, v in zip(outs, vals))

                owner.kill()
                owner.wait(10)
                for o in outs:
                    o.zero_()
                t0 = time.monotonic()
                got = reader.read(keys, [[o] for o in outs])
                assert time.monotonic() - t0 < 2.0  # deadline: timeout + bytes/min_bandwidth; blocking takes 4.5 s+
                assert got == [False] * 4
                # the master drops the dead owner's objects; the reader is healthy and claims none of them
                assert wait_for(lambda: reader.available and reader.contains(keys) == [False] * 4, 15)
                assert reader.write([k(9, "o")], [[blob(9, 1000)]]) == [True]
            finally:
                reader.close()
        finally:
            if owner.poll() is None:
                owner.kill()
                owner.wait(10)


def test_full_pool_refuses_and_counts_and_stays_healthy():
    with MooncakeMaster() as m:
        opts = m.tier_config(segment="16MiB", namespace=uuid.uuid4().hex)
        opts.pop("medium")
        tier = DramPoolTier.from_config("pool", opts)
        try:
            size = 1 << 20
            first = [k(i, "p") for i in range(12)]
            vals = [blob(i, size) for i in range(12)]
            ok = tier.write(first, [[v] for v in vals])
            assert sum(ok) >= 8
            # reading takes a lease on every object, so the master cannot evict them to make room
            outs = [torch.zeros(size, dtype=torch.uint8) for _ in first]
            got = tier.read(first, [[o] for o in outs])
            assert all(torch.equal(o, v) for o, v, g in zip(outs, vals, got) if g)
            more = [k(100 + i, "p") for i in range(12)]
            t0 = time.monotonic()
            ok2 = tier.write(more, [[blob(100 + i, size)] for i in range(12)])
            assert time.monotonic() - t0 < 2.0  # one short retry, no waiting for space
            refused = ok.count(False) + ok2.count(False)
            assert refused > 0
            st = tier.extra_stats()
            assert st["refused"] == refused and st["full_retries"] >= 1
            assert st["available"] is True and tier.available
            # healthy: once space frees up (leases expire, the master evicts) writes succeed again
            assert wait_for(lambda: tier.write([k(999, "p")], [[blob(999, size)]]) == [True], 20, 0.5)
        finally:
            tier.close()
