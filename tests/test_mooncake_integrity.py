"""Integrity in a real Mooncake pool: an object changed behind tierkv's back is a miss, counted, never wrong bytes,
in this process and in another (the checksum travels inside the object)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch
from mooncake_util import HOST, Holder, MooncakeMaster, client_env, missing_reason

from tierkv.checksum import ReadSums, chunk_sum, read_trailer, trailer_buffers
from tierkv.outcome import MissReason
from tierkv.store import TieredStore

pytestmark = [pytest.mark.mooncake, pytest.mark.slow,
              pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]

HERE = os.path.dirname(os.path.abspath(__file__))
N = 64 << 10


def chunk(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)


class RawClient:
    """A plain Mooncake client, no tierkv: replaces objects under tierkv's keys with other bytes."""

    def __init__(self, m: MooncakeMaster) -> None:
        os.environ.update(client_env())
        import mooncake.store as ms

        self.store = ms.MooncakeDistributedStore()
        # no segment of its own: what it puts lands in the tierkv clients' segments
        rc = self.store.setup(HOST, m.metadata_server, 0, 16 << 20, "tcp", "", m.master)
        assert rc == 0, rc

    def replace(self, key: str, data: bytes) -> None:
        """Remove ``key`` (waiting out the read lease a get or put left on it), then put ``data`` under it."""
        for _ in range(400):
            rc = self.store.remove(key)
            if rc == 0:
                break
            assert rc == -706, rc  # leased: the lease ends within the master's lease_ttl
            time.sleep(0.01)
        assert rc == 0
        assert self.store.put(key, data) == 0
        assert self.store.get_size(key) == len(data)

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def master():
    with MooncakeMaster(lease_ttl_ms=200) as m:
        yield m


def test_an_object_overwritten_in_the_pool_is_a_miss_counted_never_wrong_bytes(master, caplog):
    ns = f"integ-{uuid.uuid4().hex[:8]}"
    pool = master.tier_config(segment="32MiB", namespace=ns)
    keys = ["same_size", "chunk_size", "tiny", "untouched"]
    vals = [chunk(i) for i in range(4)]
    raw = RawClient(master)
    try:
        with TieredStore.from_config({"tiers": [pool]}) as s:
            assert s.put(keys, vals) == [True] * 4
            full = [f"{ns}/dram_pool/{k}" for k in keys]
            size = raw.store.get_size(full[0])
            assert size > N  # the object carries its checksum after the chunk's bytes
            # other bytes under the same keys: the object's size, the chunk's size, and another size
            raw.replace(full[0], bytes(vals[0].numpy().tobytes()) + bytes(size - N))
            raw.replace(full[1], bytes(reversed(vals[1].numpy().tobytes())))
            raw.replace(full[2], b"x" * 100)
            outs = [torch.zeros(N, dtype=torch.uint8) for _ in keys]
            got = s.get(keys, outs)
            assert got == [False, False, False, True]
            assert torch.equal(outs[3], vals[3])
            st = s.stats()["tiers"]["dram_pool"]
            assert st["corrupt"] == 3
            assert st["available"] is True  # a corrupt object is the object's fault, not the pool's
            assert s.stats()["total"]["misses"] == 3
            assert s.why_missing(keys[:3]) == [MissReason.CORRUPT] * 3
            # the bad copies are removed from the pool (once the read lease ends): a put stores the chunk again,
            # and it reads back exact
            tier = s.levels[0].tier
            deadline = time.monotonic() + 30
            # (the tier retries a removal a read lease refused; a question from here would take a lease too)
            while tier.extra_stats()["pending_deletes"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [raw.store.is_exist(k) for k in full] == [0, 0, 0, 1]
            assert s.put(keys[:1], vals[:1]) == [True]
            assert s.get(keys[:1], outs[:1]) == [True] and torch.equal(outs[0], vals[0])
    finally:
        raw.close()


# Process A stores chunks in the pool (its local tier is too small for one) and holds its segment.
WRITER = r"""
import json, sys, torch
from tierkv.outcome import MissReason
from tierkv.store import TieredStore
cfg, n = json.loads(sys.argv[1]), int(sys.argv[2])
store = TieredStore.from_config(cfg)
keys = [f"k{i}" for i in range(n)]
vals = [torch.randint(0, 256, (65536,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)) for i in range(n)]
print(json.dumps({"put": store.put(keys, vals), "where": store.locate(keys)}), flush=True)
sys.stdin.read()
store.close()
"""

# (WRITER and READER open alike: each is a whole script run with ``python -c``, so each states its own imports)
# Process B reads them: what was changed in the pool meanwhile is a miss, counted; the rest exact.
READER = r"""
import json, sys, torch
from tierkv.outcome import MissReason
from tierkv.store import TieredStore
cfg, n = json.loads(sys.argv[1]), int(sys.argv[2])
store = TieredStore.from_config(cfg)
keys = [f"k{i}" for i in range(n)]
want = [torch.randint(0, 256, (65536,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)) for i in range(n)]
outs = [torch.zeros(65536, dtype=torch.uint8) for _ in keys]
got = store.get(keys, outs)
exact = [bool(torch.equal(o, w)) for o, w in zip(outs, want)]
st = store.stats()["tiers"]["dram_pool"]
print(json.dumps({"get": got, "exact": exact, "corrupt": st["corrupt"]}), flush=True)
store.close()
"""


def test_a_chunk_corrupted_in_the_pool_is_caught_by_another_process(master):
    n = 4
    ns = f"integ-{uuid.uuid4().hex[:8]}"
    pool = master.tier_config(segment="32MiB", namespace=ns)
    cfg_a = {"tiers": [{"medium": "dram", "capacity": "16KiB"}, pool]}
    cfg_b = {"tiers": [{"medium": "dram", "capacity": "8MiB"}, pool]}
    env = {**os.environ, **client_env()}
    with Holder([sys.executable, "-c", WRITER, json.dumps(cfg_a), str(n)], cwd=HERE, env=env) as a:
        assert a.line, "writer process died"  # the handshake: A has stored every chunk
        wrote = json.loads(a.line)
        assert wrote["put"] == [True] * n and wrote["where"] == ["dram_pool"] * n
        raw = RawClient(master)
        try:
            key = f"{ns}/dram_pool/k1"
            size = raw.store.get_size(key)
            data = bytearray(raw.store.get(key))
            assert len(data) == size
            data[100] ^= 0x40  # one bit of the chunk's bytes, the trailer left as it was
            raw.replace(key, bytes(data))
        finally:
            raw.close()
        b = subprocess.run([sys.executable, "-c", READER, json.dumps(cfg_b), str(n)], cwd=HERE, env=env,
                           capture_output=True, text=True, timeout=120)
        assert b.returncode == 0, b.stderr[-3000:]
        res = json.loads(b.stdout.strip().splitlines()[-1])
    assert res["get"] == [True, False, True, True], res
    assert res["exact"][0] and res["exact"][2] and res["exact"][3], res
    assert res["corrupt"] == 1


def test_a_corrupt_object_amid_a_large_summed_local_read_is_a_miss_and_its_neighbours_hits(master):
    # 8 chunks of 2 MiB: served from this node's own segment, summed as they are copied, on two threads
    ns = f"integ-{uuid.uuid4().hex[:8]}"
    pool = master.tier_config(segment="64MiB", namespace=ns)
    n, size = 8, 2 << 20
    keys = [f"big{i}" for i in range(n)]
    vals = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(50 + i))
            for i in range(n)]
    raw = RawClient(master)
    try:
        with TieredStore.from_config({"tiers": [pool]}) as s:
            assert s.put(keys, vals) == [True] * n
            tier = s.levels[0].tier
            assert tier.sums_copies
            full = f"{ns}/dram_pool/{keys[3]}"
            data = bytearray(raw.store.get(full))
            data[size - 1] ^= 0x01  # the chunk's last byte, the trailer left as it was
            raw.replace(full, bytes(data))
            # the medium's own answer: each object's sum, of the bytes it copied (the trailer left out)
            outs = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
            objs = [[o, t] for o, t in zip(outs, trailer_buffers(n))]
            asked = ReadSums([size] * n)
            assert tier.read(keys, objs, asked) == [True] * n
            assert asked.sums == [chunk_sum([o]) for o in outs]
            assert asked.sums[3] != read_trailer(objs[3][1]) and asked.sums[2] == read_trailer(objs[2][1])
            before = tier.extra_stats()["local_reads"]
            outs = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
            assert s.get(keys, outs) == [True] * 3 + [False] + [True] * 4
            assert all(torch.equal(outs[i], vals[i]) for i in range(n) if i != 3)
            assert tier.extra_stats()["local_reads"] - before == n  # (the summed local path served every one)
            assert s.stats()["tiers"]["dram_pool"]["corrupt"] == 1
            assert s.why_missing([keys[3]]) == [MissReason.CORRUPT]
    finally:
        raw.close()
