"""``dram_pool`` attached to a standalone Mooncake pool: the pool outlives the engine.

Real processes on 127.0.0.1: a ``mooncake_master``, a ``mooncake_client`` that
owns the pool memory (``StandalonePool``), and engine processes that attach with
``"mode": "standalone"`` (segment 0) and come and go.
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
from tier_conformance import TierConformance, blob

from tierkv.errors import ConfigError
from tierkv.store import TieredStore
from tierkv.tiers.remote.media import DramPoolTier
from tierkv.tiers.remote.standalone import StandalonePool, client_binary, main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_reason = missing_reason() or (None if client_binary() else "mooncake_client binary not found")
needs_pool = pytest.mark.skipif(_reason is not None, reason=str(_reason))
pytestmark = [pytest.mark.mooncake]

BASE = {"master": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:1/metadata"}


def k(i: int, tag: str = "s") -> str:
    return f"{tag}{i:063x}"


def opts_of(cfg: dict) -> dict:
    cfg = dict(cfg)
    cfg.pop("medium")
    return cfg


# -- configuration (no processes) ------------------------------------------------------
@pytest.mark.parametrize("extra, match", [
    ({"mode": "standalone", "segment": "64MiB"}, "contributes no segment"),
    ({"mode": "embedded", "segment": 0}, "embedded mode needs a segment"),
    ({"mode": "shared"}, "option 'mode'"),
    ({"mode": "standalone", "local_reads": True}, "local_reads"),
    ({"local_reads": "false"}, "local_reads"),           # a string is never a bool
    ({"timeout": "1"}, "option 'timeout'"),               # nor a number
    ({"workers": "4"}, "option 'workers'"),
    ({"workers": 0}, "option 'workers'"),
    ({"presence_ttl": 0}, "option 'presence_ttl'"),
    ({"preferred_segment": 5}, "option 'preferred_segment'"),
    ({"device_name": 0}, "option 'device_name'"),
    ({"buffer": "lots"}, "option 'buffer'"),
    ({"min_bandwidth": True}, "option 'min_bandwidth'"),
    ({"namespace": ""}, "option 'namespace'"),
])
def test_bad_options_name_the_option(extra, match):
    with pytest.raises(ConfigError, match=match):
        DramPoolTier.from_config("pool", {**BASE, **extra})


def test_standalone_is_a_dram_pool_mode():
    from tierkv.tiers.remote.media import RemoteNPUTier

    with pytest.raises(ConfigError, match="dram_pool mode"):
        RemoteNPUTier.from_config("r", {**BASE, "mode": "standalone"})
    with pytest.raises(ConfigError, match="does not serve remote_npu"):
        RemoteNPUTier.from_config("r", {**BASE, "backend": "memcache"})


def test_segment_zero_selects_standalone_mode():
    from tierkv.tiers.remote.mooncake import pop_mooncake_settings

    for extra in ({"segment": 0}, {"segment": "0"}, {"mode": "standalone"}):
        s = pop_mooncake_settings("pool", "dram_pool", {**BASE, **extra})
        assert s.segment_bytes == 0 and s.standalone and s.local_reads is False
    s = pop_mooncake_settings("pool", "dram_pool", dict(BASE))
    assert s.segment_bytes == 512 << 20 and not s.standalone and s.local_reads is True


def test_pool_command_line_and_cli_dry_run(capsys):
    pool = StandalonePool("10.0.0.1:50051", "http://10.0.0.1:8080/metadata", "8GiB", host="10.0.0.2", port=50052)
    cmd = pool.command
    assert "--global_segment_size=8GB" in cmd and "--local_buffer_size=0" in cmd
    assert "--master_server_address=10.0.0.1:50051" in cmd and "--host=10.0.0.2" in cmd and "--port=50052" in cmd
    assert pool.environment()["MC_TCP_BIND_ADDRESS"] == "10.0.0.2"
    cfg = pool.tier_config()
    assert cfg["mode"] == "standalone" and cfg["medium"] == "dram_pool" and "segment" not in cfg
    assert main(["--master", "10.0.0.1:50051", "--metadata-server", "http://10.0.0.1:8080/metadata",
                 "--segment", "512MiB", "--dry-run"]) == 0
    assert "--global_segment_size=512MB" in capsys.readouterr().out
    assert main(["--master", "nohost", "--metadata-server", "http://x/metadata"]) == 2
    with pytest.raises(ConfigError, match="segment"):
        StandalonePool("10.0.0.1:50051", "http://x/metadata", "lots")
    for bad, match in (({"port": "50052"}, "port"), ({"threads": "2"}, "threads"),
                       ({"protocol": "udp"}, "protocol")):
        with pytest.raises(ConfigError, match=match):
            StandalonePool("10.0.0.1:50051", "http://x/metadata", "1GiB", **bad)


# -- the contract, attached to a standalone pool (through the Transfer Engine, or over IPC) --------
@pytest.fixture(scope="module")
def shared_pool():
    if _reason:
        pytest.skip(_reason)
    with MooncakeMaster() as m, m.standalone_pool("128MiB") as pool:
        yield pool


@pytest.fixture(scope="class")
def class_tiers():
    made: dict = {}
    yield made
    for t in made.values():
        t.close()


@needs_pool
class TestStandaloneConformance(TierConformance):
    ipc = False

    @pytest.fixture
    def make_tier(self, class_tiers, shared_pool):
        def make(cap):
            if cap not in class_tiers:
                cfg = shared_pool.tier_config(ipc=self.ipc, capacity=cap, namespace=uuid.uuid4().hex)
                class_tiers[cap] = DramPoolTier.from_config("pool", opts_of(cfg))
            return class_tiers[cap]
        return make


@needs_pool
class TestStandaloneIPCConformance(TestStandaloneConformance):
    ipc = True


@needs_pool
def test_ipc_batches_are_cut_to_the_shared_memory_and_larger_objects_refused(shared_pool):
    cfg = shared_pool.tier_config(ipc=True, ipc_buffer="4MiB", namespace=uuid.uuid4().hex)
    tier = DramPoolTier.from_config("pool", opts_of(cfg))
    try:
        assert tier.available and "IPC" in tier.description
        keys = [k(i, "ipc") for i in range(6)]
        vals = [blob(i, 1536 << 10) for i in range(6)]  # 9 MiB in all: three backend calls
        assert tier.write(keys, [[v[:1000], v[1000:]] for v in vals]) == [True] * 6
        outs = [torch.zeros(1536 << 10, dtype=torch.uint8) for _ in keys]
        assert tier.read(keys, [[o] for o in outs]) == [True] * 6
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
        assert tier.write([k(9, "ipc")], [[blob(9, 5 << 20)]]) == [False]  # cannot fit: refused, counted
        assert tier.extra_stats()["refused"] == 1 and tier.available
        assert tier.extra_stats()["local_reads"] == 0
    finally:
        tier.close()


@pytest.mark.parametrize("extra, match", [
    ({"standalone_address": "127.0.0.1:50052", "segment": "64MiB"}, "standalone-mode option"),
    ({"mode": "standalone", "standalone_address": "nohost"}, "standalone_address"),
    ({"mode": "standalone", "ipc_buffer": "8MiB"}, "needs 'standalone_address'"),
])
def test_ipc_options_are_checked(extra, match):
    with pytest.raises(ConfigError, match=match):
        DramPoolTier.from_config("pool", {**BASE, **extra})


# -- the pool outlives the engine --------------------------------------------------------
WRITER = r"""
import json, sys, torch
from tierkv.store import TieredStore
cfg, n = json.loads(sys.argv[1]), int(sys.argv[2])
keys = [f"{i:064x}" for i in range(1, n + 1)]
g = torch.Generator().manual_seed(4321)
vals = [[torch.randint(0, 256, (48 << 10,), dtype=torch.uint8, generator=g) for _ in range(4)] for _ in keys]
with TieredStore.from_config(cfg) as store:
    ok = store.put(keys, vals)
    print(json.dumps({"put": ok, "where": store.locate(keys)}), flush=True)
"""

READER = r"""
import json, sys, torch
from tierkv.store import TieredStore
cfg, n = json.loads(sys.argv[1]), int(sys.argv[2])
keys = [f"{i:064x}" for i in range(1, n + 1)]
g = torch.Generator().manual_seed(4321)
want = [torch.cat([torch.randint(0, 256, (48 << 10,), dtype=torch.uint8, generator=g) for _ in range(4)])
        for _ in keys]
with TieredStore.from_config(cfg) as store:
    found = store.lookup(keys)
    outs = [torch.zeros(4 * (48 << 10), dtype=torch.uint8) for _ in keys]
    got = store.get(keys, outs)
    exact = [bool(x and torch.equal(o, w)) for x, o, w in zip(got, outs, want)]
    print(json.dumps({"lookup": found, "get": got, "exact": exact,
                      "absent": store.lookup([f"{0xdead:064x}"])}), flush=True)
"""


def run_py(code: str, *args: str, timeout: float = 120) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=HERE, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_pool
@pytest.mark.slow
@pytest.mark.parametrize("ipc", [False, True], ids=["transfer-engine", "ipc"])
def test_process_b_reads_every_chunk_process_a_stored_and_exited(ipc):
    n = 10
    with MooncakeMaster() as m, m.standalone_pool("128MiB") as pool:
        assert pool.segment, "the pool's segment is listed by the master once start() returns"
        tier = pool.tier_config(ipc=ipc, namespace=f"outlive-{uuid.uuid4().hex}")
        # A's local tier is too small for a chunk: everything it stores lives only in the pool
        wrote = run_py(WRITER, json.dumps({"tiers": [{"medium": "dram", "capacity": "64KiB"}, tier]}), str(n))
        assert wrote["put"] == [True] * n and wrote["where"] == ["dram_pool"] * n
        # A has exited (run_py waited for it): B is a new process with nothing shared but the pool
        res = run_py(READER, json.dumps({"tiers": [{"medium": "dram", "capacity": "8MiB"}, tier]}), str(n))
        assert res["lookup"] == n, res
        assert res["get"] == [True] * n and res["exact"] == [True] * n, res
        assert res["absent"] == 0


@needs_pool
@pytest.mark.slow
@pytest.mark.parametrize("ipc", [False, True], ids=["transfer-engine", "ipc"])
def test_standalone_client_killed_misses_then_the_store_recovers_by_itself(ipc):
    with MooncakeMaster() as m, m.standalone_pool("64MiB") as pool:
        pool_cfg = pool.tier_config(ipc=ipc, namespace=uuid.uuid4().hex, probe_interval=0.2, timeout=0.5)
        cfg = {"tiers": [{"medium": "dram", "capacity": "1MiB"}, pool_cfg]}
        with TieredStore.from_config(cfg) as store:
            tier = store.levels[1].tier
            session = tier._session
            keys = [k(i) for i in range(16)]
            vals = [blob(i, 128 << 10) for i in range(16)]
            assert store.put(keys, vals) == [True] * 16
            outs = [torch.zeros(128 << 10, dtype=torch.uint8) for _ in keys]
            assert store.get(keys, outs) == [True] * 16
            store.drain_write_behind()  # (the promotions those hits queued have landed)
            where = store.locate(keys)  # after the reads: hits in the pool may have been promoted
            local = [i for i, w in enumerate(where) if w == "dram"]
            remote = [i for i, w in enumerate(where) if w == "dram_pool"]
            assert local and remote, where

            pool.kill()  # the pool memory is gone, objects included
            for _ in range(5):
                got = store.get(keys, outs)  # never raises
                assert all(got[i] and torch.equal(outs[i], vals[i]) for i in local)
                assert not any(got[i] for i in remote)
                time.sleep(0.3)  # time passing on purpose: gets keep missing, never raising, over probe rounds
            assert store.put([k(100)], [blob(100, 1000)]) == [True]  # the local tier still takes writes
            assert tier.write([k(101)], [[blob(101, 64 << 10)]]) == [False]  # no pool memory: refused
            assert wait_for(lambda: not tier.available, 10)

            pool.restart()
            assert wait_for(lambda: tier.available, 30), json.dumps(tier.extra_stats())
            # the engine's store restarted nothing; through the Transfer Engine even its client is the same
            # (over IPC a client the restarted pool does not know is replaced by the tier itself)
            if not ipc:
                assert tier._session is session and tier.extra_stats()["abandoned_clients"] == 0
            lost = [keys[i] for i in remote]
            # lost, never read: a get of them misses (no bytes), and once the master has dropped the dead
            # client's segment (its client TTL: a few seconds) no lookup claims them
            assert store.get(lost, [outs[i] for i in remote]) == [False] * len(remote)
            assert wait_for(lambda: tier.available and tier.contains(lost) == [False] * len(remote), 30)
            fresh = blob(7, 64 << 10)
            assert tier.write([k(200)], [[fresh]]) == [True]
            out = torch.zeros_like(fresh)
            assert tier.read([k(200)], [[out]]) == [True] and torch.equal(out, fresh)
            assert tier.extra_stats()["reconnects"] >= 1


FLOOD = r"""
import json, sys, torch
from tierkv.tiers.remote.media import DramPoolTier
opts = json.loads(sys.argv[1])
tier = DramPoolTier.from_config("flood", opts)
i = 0
while True:  # batches of 1 MiB chunks whose bytes follow from their index, until killed
    idx = list(range(i, i + 8))
    vals = [torch.full((1 << 20,), j % 251, dtype=torch.uint8) for j in idx]
    vals = [v.add_(torch.arange(1 << 20, dtype=torch.uint8)) for v in vals]
    ok = tier.write([f"c{j:063x}" for j in idx], [[v] for v in vals])
    print(json.dumps({"upto": i + 8, "ok": sum(ok)}), flush=True)
    i += 8
"""


@needs_pool
@pytest.mark.slow
@pytest.mark.parametrize("ipc", [False, True], ids=["transfer-engine", "ipc"])
def test_engine_killed_mid_transfer_leaves_the_pool_consistent(ipc):
    with MooncakeMaster() as m, m.standalone_pool("96MiB") as pool:
        opts = opts_of(pool.tier_config(ipc=ipc, namespace=uuid.uuid4().hex, presence_ttl=0.01))
        eng = subprocess.Popen([sys.executable, "-c", FLOOD, json.dumps(opts)], cwd=HERE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            upto = 0
            while upto < 24:  # a few batches committed, then killed while it is moving the next
                line = eng.stdout.readline()
                assert line, "the writer died"
                upto = json.loads(line)["upto"]
            eng.send_signal(signal.SIGKILL)
            eng.wait(10)
        finally:
            if eng.poll() is None:
                eng.kill()
                eng.wait(10)
        reader = DramPoolTier.from_config("reader", dict(opts))
        try:
            def check(all_claimed_readable: bool) -> int:
                keys = [f"c{j:063x}" for j in range(upto + 16)]
                present = reader.contains(keys)
                claimed = [j for j, p in enumerate(present) if p]
                outs = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in claimed]
                got = reader.read([keys[j] for j in claimed], [[o] for o in outs])
                for j, g, o in zip(claimed, got, outs):
                    want = torch.full((1 << 20,), j % 251, dtype=torch.uint8).add_(
                        torch.arange(1 << 20, dtype=torch.uint8))
                    if g:
                        assert torch.equal(o, want), f"chunk {j} read as a hit with other bytes"
                    else:
                        assert not all_claimed_readable, f"chunk {j} claimed but not readable"
                return sum(got)
            assert check(False) >= 16  # the committed batches are all there, exact; nothing wrong is a hit
            time.sleep(3)  # past the master's client TTL: whatever the dead engine left half-done is revoked
            assert check(True) >= 16
            fresh = blob(3, 1 << 20)
            assert reader.write([k(1, "n")], [[fresh]]) == [True]
            out = torch.zeros_like(fresh)
            assert reader.read([k(1, "n")], [[out]]) == [True] and torch.equal(out, fresh)
        finally:
            reader.close()


@needs_pool
@pytest.mark.slow
def test_pool_cli_runs_until_sigterm_and_takes_its_client_along():
    with MooncakeMaster() as m:
        port = StandalonePool(m.master, m.metadata_server, "32MiB").port
        cli = subprocess.Popen([sys.executable, "-m", "tierkv.tiers.remote.standalone", "--master", m.master,
                                "--metadata-server", m.metadata_server, "--segment", "32MiB", "--port", str(port),
                                "--master-http", m.master_http], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            started = json.loads(cli.stdout.readline())
            assert started["pool"] == "started" and started["segment"]
            tier = DramPoolTier.from_config("p", opts_of(started["tier_config"]))
            try:
                v = blob(1, 4096)
                assert tier.write([k(1, "cli")], [[v]]) == [True]
            finally:
                tier.close()
            cli.send_signal(signal.SIGTERM)
            assert cli.wait(20) == 0
            assert wait_for(lambda: not _alive(started["pid"]), 10), "mooncake_client outlived the CLI"
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of the (ended) CLI is reaped by init; treat it as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
