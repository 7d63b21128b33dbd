"""Large objects in the ssd tier: any chunk the store can hold is storable, whatever the region size.

An object too large for one record is stored as pieces and a manifest (``tiers/ssd/large.py``), with
every guarantee of a small one: exact bytes or a miss, durable after flush, found after a restart,
removed stays removed, reclaimed, within capacity, in every write mode.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from test_ssd_engine import direct_ok

from tierkv import TieredStore
from tierkv.outcome import PutOutcome
from tierkv.tiers.ssd import SSDTier
from tierkv.tiers.ssd import large as L

MiB = 1 << 20
LLAMA3_8B_CHUNK = 256 * 2 * 32 * 8 * 128 * 2  # 256 tokens x (K, V) x 32 layers x 8 KV heads x 128 x bf16


MODES = {"buffered": {"direct_io": False}, "o_direct": {"direct_io": True},
         "lz4": {"direct_io": False, "compression": "lz4"}}


@pytest.fixture(params=list(MODES))
def mode(request, tmp_path):
    opts = MODES[request.param]
    if opts["direct_io"] and not direct_ok(tmp_path / "probe"):
        pytest.skip("O_DIRECT is not supported here")
    return dict(opts)


def val(seed: int, n: int) -> torch.Tensor:
    """Bytes that differ from piece to piece and compress a little (lz4 keeps some, stores them)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    v[: n // 4] = seed % 251
    return v


def read(t, keys, sizes):
    outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    return t.read(keys, [[o] for o in outs]), outs


# -- the size rule ---------------------------------------------------------------------------
def test_the_size_rule_one_record_up_to_single_then_pieces_within_a_slot():
    for rs in (1 * MiB, 4 * MiB + 4096, 64 * MiB, 2048 * MiB):
        g = L.Geometry.of(rs)
        max_slot = (rs - 2 * 4096 - 64) // 8
        assert L.record_footprint(g.single) <= max_slot  # the largest single record fits a slot
        assert all(L.record_footprint(g.single + d) > max_slot for d in (64, 4096))
        for total in (g.single + 1, 2 * g.single, 5 * g.single + 7, 8 * MiB, LLAMA3_8B_CHUNK):
            if total <= g.single:
                continue
            count, piece = g.layout(total)
            assert count >= 2 and piece + L.NONCE <= g.single and (count - 1) * piece < total <= count * piece
            # the footprint is the pieces' and the manifest's, each a record of its own
            assert g.footprint(total) >= total + count * L.NONCE
            assert g.footprint(np.array([total]))[0] == g.footprint(total)
        # lengths are 32-bit: a longer object takes more than any tier holds, so the store refuses it
        assert g.footprint(L.MAX_OBJECT + 1) == L.NEVER > g.footprint(L.MAX_OBJECT)


# -- the documented examples -------------------------------------------------------------------
def test_8mib_chunks_are_stored_in_the_default_64mib_regions(tmp_path, mode):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 256 * MiB, path, **mode)
    assert t.region_size == 64 * MiB
    keys = [f"c{i}" for i in range(6)]
    assert t.write(keys, [[val(i, 8 * MiB)] for i in range(6)]) == [True] * 6
    st = t.extra_stats()
    assert st["objects"] == 6 and st["large_objects"] == 6 and st["too_large"] == 0
    assert t.used_bytes <= 6 * t.footprint(8 * MiB)
    ok, outs = read(t, keys, [8 * MiB] * 6)
    assert ok == [True] * 6 and all(torch.equal(o, val(i, 8 * MiB)) for i, o in enumerate(outs))
    t.close()
    t = SSDTier("ssd", 256 * MiB, path, **mode)
    assert sorted(t.recover()) == [(k, 8 * MiB) for k in keys]  # the pieces are no objects of their own
    ok, outs = read(t, keys, [8 * MiB] * 6)
    assert ok == [True] * 6 and all(torch.equal(o, val(i, 8 * MiB)) for i, o in enumerate(outs))
    t.close()


def test_a_llama3_8b_chunk_through_dram_above_ssd_is_flushed_and_read_back_from_ssd(tmp_path, mode):
    """The README's example: a 32 MiB chunk put into a store whose dram tier writes behind to ssd."""
    path = str(tmp_path / "s")
    ssd = {"medium": "ssd", "path": path, "capacity": "1GiB", **mode}
    chunk = val(3, LLAMA3_8B_CHUNK)
    assert chunk.numel() == 32 * MiB
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "128MiB"}, ssd]}) as store:
        assert store.put_detailed(["llama"], [chunk]) == [PutOutcome.STORED]
        res = store.flush()
        assert res and res.not_durable == 0
        st = store.levels[1].tier.extra_stats()
        assert st["objects"] == 1 and st["too_large"] == 0
    with TieredStore.from_config({"tiers": [ssd]}) as store:
        assert store.locate(["llama"]) == ["ssd"]
        st = store.stats()["ssd"]
        assert st["entries"] == st["objects"] == 1  # the chunk, not its pieces
        assert st["used_bytes"] == store.levels[0].tier.footprint(32 * MiB)
        out = torch.empty(32 * MiB, dtype=torch.uint8)
        assert store.get(["llama"], [out]) == [True]
        assert torch.equal(out, chunk)


def test_a_chunk_larger_than_the_tier_is_rejected_counted_and_logged(tmp_path, caplog):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, path, region_size="1MiB")
    with caplog.at_level(logging.WARNING):
        assert t.write(["a", "b"], [[val(1, 17 * MiB)], [val(2, 17 * MiB)]]) == [False, False]
    assert t.extra_stats()["too_large"] == 2
    assert len([r for r in caplog.records if "larger than the tier" in r.getMessage()]) == 1  # at most 1 a minute
    assert t.write(["c"], [[val(3, 15 * MiB)]]) == [True]  # what fits is stored, though far over a region
    t.close()
    cfg = {"tiers": [{"medium": "ssd", "path": path, "capacity": "16MiB", "region_size": "1MiB"}]}
    with TieredStore.from_config(cfg) as store:  # the store refuses it before the tier: REJECTED, never ERROR
        assert store.put_detailed(["big"], [val(4, 17 * MiB)]) == [PutOutcome.REJECTED]
        assert store.put_detailed(["fits"], [val(5, 3 * MiB)]) == [PutOutcome.STORED]
        st = store.stats()["tiers"]["ssd"]
        assert st["rejected"] == 1 and st["too_large"] == 1
    cfg = {"tiers": [{"medium": "dram", "capacity": "8MiB"},
                     {"medium": "ssd", "path": str(tmp_path / "s2"), "capacity": "16MiB", "region_size": "1MiB"}]}
    with TieredStore.from_config(cfg) as store:
        assert store.put_detailed(["big"], [val(4, 17 * MiB)]) == [PutOutcome.REJECTED]


# -- larger than a region ----------------------------------------------------------------------
def test_chunks_larger_than_a_region_are_stored_read_and_found_after_a_restart(tmp_path, mode):
    path = str(tmp_path / "s")
    sizes = [3 * MiB + 5, MiB, 200_000, 2 * MiB - 1, 5000]
    keys = [f"k{i}" for i in range(len(sizes))]
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", **mode)
    assert sizes[0] > t.region_size
    assert t.write(keys, [[val(i, n)] for i, n in enumerate(sizes)]) == [True] * len(sizes)
    assert t.used_bytes <= sum(t.footprint(n) for n in sizes)
    # a value given as several parts, split across pieces
    parts = [val(9, 700_000), val(10, 1), val(11, 900_000)]
    assert t.write(["parts"], [parts]) == [True]
    whole = torch.cat(parts)
    t.flush()
    t.close()
    for reopen in ("checkpoint", "summaries"):
        if reopen == "summaries":
            os.unlink(os.path.join(path, "checkpoint"))
        t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", **mode)
        assert t.recovered_from == reopen
        assert sorted(t.recover()) == sorted([*zip(keys, sizes), ("parts", whole.numel())])
        ok, outs = read(t, [*keys, "parts"], [*sizes, whole.numel()])
        assert ok == [True] * (len(sizes) + 1)
        assert all(torch.equal(o, val(i, n)) for i, (o, n) in enumerate(zip(outs, sizes)))
        assert torch.equal(outs[-1], whole)
        # read into several parts, of other boundaries than the pieces'
        dst = [torch.zeros(1000, dtype=torch.uint8), torch.zeros(sizes[0] - 1000, dtype=torch.uint8)]
        assert t.read(["k0"], [dst]) == [True] and torch.equal(torch.cat(dst), val(0, sizes[0]))
        assert t.read(["k0"], [[torch.zeros(sizes[0] - 1, dtype=torch.uint8)]]) == [False]  # another size
        t.close()


def test_removed_large_objects_stay_removed_and_free_their_pieces(tmp_path, mode):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", **mode)
    assert t.write(["a", "b", "s"], [[val(1, 3 * MiB)], [val(2, 2 * MiB)], [val(3, 1000)]]) == [True] * 3
    t.flush()
    t.delete(["a"])
    assert t.contains(["a", "b", "s"]) == [False, True, True]
    assert t.used_bytes <= t.footprint(2 * MiB) + t.footprint(1000)  # the pieces went with the manifest
    t.flush()
    t.close()
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", **mode)
    assert sorted(t.recover()) == [("b", 2 * MiB), ("s", 1000)]
    assert t.extra_stats()["objects"] == 2
    ok, outs = read(t, ["a", "b"], [3 * MiB, 2 * MiB])
    assert ok == [False, True] and torch.equal(outs[1], val(2, 2 * MiB))
    t.close()


def test_a_large_object_put_again_replaces_its_pieces(tmp_path, mode):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", **mode)
    assert t.write(["a"], [[val(1, 4 * MiB)]]) == [True]
    assert t.write(["a"], [[val(2, 2 * MiB)]]) == [True]  # fewer pieces: the others go
    assert t.used_bytes <= t.footprint(2 * MiB)
    ok, (out,) = read(t, ["a"], [2 * MiB])
    assert ok == [True] and torch.equal(out, val(2, 2 * MiB))
    assert t.write(["a"], [[val(3, 100)]]) == [True]  # a small value: every piece goes
    assert t.used_bytes <= t.footprint(100)
    t.close()
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", **mode)
    assert t.recover() == [("a", 100)] and t.extra_stats()["objects"] == 1
    t.close()


def test_a_corrupt_piece_is_a_miss_that_drops_the_object(tmp_path):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", direct_io=False)
    v = val(1, 3 * MiB)
    assert t.write(["a", "b"], [[v], [val(2, 1000)]]) == [True, True]
    t.close()
    # flip one byte in the middle of the object's bytes, wherever its piece lies
    needle = v[2 * MiB:2 * MiB + 64].numpy().tobytes()
    for name in sorted(os.listdir(os.path.join(path, "regions"))):
        f = os.path.join(path, "regions", name)
        data = bytearray(open(f, "rb").read())
        at = data.find(needle)
        if at >= 0:
            data[at + 10] ^= 0xFF
            open(f, "wb").write(data)
            break
    else:
        raise AssertionError("the object's bytes were not found")
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", direct_io=False)
    ok, outs = read(t, ["a", "b"], [3 * MiB, 1000])
    assert ok == [False, True]
    assert t.extra_stats()["corrupt"] >= 1 and t.contains(["a"]) == [False]
    assert t.extra_stats()["objects"] == 1 and t.used_bytes <= t.footprint(1000)
    t.close()


# -- reclamation -------------------------------------------------------------------------------
def test_mixed_sizes_under_reclamation_always_fit_and_read_back(tmp_path, mode):
    """Random small and large objects, random removals, always within capacity by footprint: every write
    succeeds while regions are reclaimed, and every live object reads back exact, also after a restart."""
    cap = 12 * MiB
    path = str(tmp_path / "s")
    t = SSDTier("ssd", cap, path, region_size="1MiB", **mode)
    rnd = random.Random(11)
    live: dict[str, tuple[int, int]] = {}
    used = 0
    for step in range(160):
        n = rnd.choice([rnd.randint(1, 60_000), rnd.randint(100_000, 400_000), rnd.randint(MiB, 3 * MiB)])
        while live and used + t.footprint(n) > cap:
            k = rnd.choice(sorted(live))
            used -= t.footprint(live.pop(k)[1])
            t.delete([k])
        k = f"k{step}"
        assert t.write([k], [[val(step, n)]]) == [True], f"step {step}: {n} bytes refused"
        live[k] = (step, n)
        used += t.footprint(n)
        assert t.used_bytes <= used
    assert t.extra_stats()["gc_runs"] > 0
    keys = sorted(live)
    ok, outs = read(t, keys, [live[k][1] for k in keys])
    assert all(ok) and all(torch.equal(o, val(*live[k])) for k, o in zip(keys, outs))
    t.close()
    t = SSDTier("ssd", cap, path, region_size="1MiB", **mode)
    assert sorted(t.recover()) == sorted((k, n) for k, (_, n) in live.items())
    ok, outs = read(t, keys, [live[k][1] for k in keys])
    assert all(ok) and all(torch.equal(o, val(*live[k])) for k, o in zip(keys, outs))
    assert t.extra_stats()["corrupt"] == 0
    t.close()


def test_a_smaller_capacity_on_reopen_keeps_whole_large_objects(tmp_path):
    path = str(tmp_path / "s")
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", direct_io=False)
    for i in range(6):
        assert t.write([f"k{i}"], [[val(i, 3 * MiB)]]) == [True]
    t.close()
    t = SSDTier("ssd", 8 * MiB, path, region_size="1MiB", direct_io=False)
    kept = t.recover()
    assert kept == [(f"k{i}", 3 * MiB) for i in range(6 - len(kept), 6)] and len(kept) == 2  # the newest
    assert t.used_bytes <= 2 * t.footprint(3 * MiB) and t.extra_stats()["objects"] == 2
    ok, outs = read(t, [k for k, _ in kept], [3 * MiB] * 2)
    assert ok == [True, True] and torch.equal(outs[1], val(5, 3 * MiB))
    t.close()


# -- crashes ---------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import os, sys, torch
    from tierkv.tiers.ssd import SSDTier
    from tierkv.tiers.ssd.segmentwriter import SegmentWriter
    path, where, opts = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    def val(seed, n):
        g = torch.Generator().manual_seed(seed)
        v = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        v[: n // 4] = seed % 251
        return v
    t = SSDTier("ssd", 64 << 20, path, region_size="1MiB", **opts)
    t.write(["s0", "s1", "big"], [[val(1, 5000)], [val(2, 300_000)], [val(3, 3 << 20)]])
    t.flush()
    t.write(["s2"], [[val(4, 7000)]])
    commits = [0]
    real_commit, real_put_one = SegmentWriter.commit, SegmentWriter._put_one
    def stop(msg):
        print(msg, flush=True)
        sys.stdin.readline()  # (killed here)
    def commit(self, seg, out):  # (called at each region change and before each piece that goes alone)
        real_commit(self, seg, out)
        commits[0] += 1
        if commits[0] == 3 and where == "pieces":
            r = self._table.active
            self._io.write_out(r, -(-r.pos // 4096) * 4096, r.pos)
            stop("mid-pieces")
    def put_one(self, key, parts, large_total=0):
        if large_total and where == "manifest":
            r = self._table.active
            self._io.write_out(r, -(-r.pos // 4096) * 4096, r.pos)
            stop("before-manifest")
        return real_put_one(self, key, parts, large_total)
    SegmentWriter.commit, SegmentWriter._put_one = commit, put_one
    t.write([sys.argv[4]], [[val(5, 3 << 20)]])
    print("done", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("where", ["pieces", "manifest"])
@pytest.mark.parametrize("target", ["new", "big"], ids=["new_key", "put_again"])
def test_a_kill_mid_large_write_leaves_the_object_whole_or_a_miss(tmp_path, mode, where, target):
    """SIGKILL after some pieces, or after all pieces but before the manifest: the large object is a miss
    (or its earlier value, whole), never wrong bytes; everything else survives; no piece is left over."""
    path = str(tmp_path / "s")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, where, repr(mode), target],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line in ("mid-pieces", "before-manifest"), line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    t = SSDTier("ssd", 64 * MiB, path, region_size="1MiB", **mode)
    found = dict(t.recover())
    assert {"s0", "s1", "big"} <= set(found)
    assert "new" not in found  # its manifest was never written
    ok, outs = read(t, ["s0", "s1", "big", "s2"], [5000, 300_000, 3 * MiB, 7000])
    assert ok[:2] == [True, True]
    assert torch.equal(outs[0], val(1, 5000)) and torch.equal(outs[1], val(2, 300_000))
    if ok[2]:  # put again: the earlier value, whole, or a miss (its pieces were being replaced)
        assert torch.equal(outs[2], val(3, 3 * MiB))
    else:
        assert target == "big"
    if ok[3]:
        assert torch.equal(outs[3], val(4, 7000))
    # no piece is left over: what the tier holds is what its objects account for
    live = [(k, n) for k, n in found.items() if k != "big" or ok[2]]
    assert t.used_bytes <= sum(t.footprint(n) for _, n in live)
    assert t.extra_stats()["objects"] == len(live)
    t.close()


# -- the simulator -----------------------------------------------------------------------------
def test_simulate_stores_large_chunks_in_ssd_as_the_real_store_does(tmp_path):
    """``tierkv simulate`` runs the real store over null media with the ssd tier's footprint rule: 32 MiB
    chunks (256 tokens of a Llama-3-8B) land in ssd as they do in a real store, and a chunk larger than
    the tier is refused in both (``too_large``)."""
    from tierkv.tiers import medium_class
    from tierkv.tools.sim import Request, replay, simulate
    from tierkv.tools.sim.replay import DEFAULT_BYTES_PER_TOKEN, footprint_rule

    rule = footprint_rule(medium_class("ssd"), {"region_size": "1MiB"})
    t = SSDTier("ssd", 64 * MiB, str(tmp_path / "probe"), region_size="1MiB")
    assert all(rule(n) == t.footprint(n) for n in (1000, t._geometry().single + 1, 3 * MiB, LLAMA3_8B_CHUNK))
    t.close()

    reqs = [Request(float(i), 512, 8, [2 * i, 2 * i + 1], 256) for i in range(4)]  # 8 chunks of 32 MiB
    assert DEFAULT_BYTES_PER_TOKEN * 256 == LLAMA3_8B_CHUNK

    def cfg(path, ssd_cap):
        return {"tiers": [{"medium": "dram", "capacity": "80MiB"},
                          {"medium": "ssd", "path": path, "capacity": ssd_cap}]}

    sim = simulate(reqs, cfg(str(tmp_path / "unused"), "160MiB")).tiers
    with TieredStore.from_config(cfg(str(tmp_path / "real"), "160MiB")) as store:
        replay(reqs, store)
        res = store.flush()
        assert res and res.not_durable == 0
        real = store.stats()["tiers"]
        assert real["ssd"]["objects"] == real["ssd"]["entries"]
    assert sim["ssd"]["entries"] == real["ssd"]["entries"] == 4  # as many as fit 160 MiB by footprint
    assert sim["ssd"]["too_large"] == real["ssd"]["too_large"] == 0
    small = simulate(reqs, cfg(str(tmp_path / "unused"), "30MiB")).tiers["ssd"]  # a chunk is more than the tier
    assert small["entries"] == 0 and small["too_large"] > 0 and small["rejected"] >= small["too_large"]


def test_inspect_counts_a_large_object_once(tmp_path):
    from tierkv.tiers.ssd import inspect_dir

    path = str(tmp_path / "s")
    t = SSDTier("ssd", 32 * MiB, path, region_size="1MiB", direct_io=False)
    assert t.write(["a", "b"], [[val(1, 3 * MiB)], [val(2, 1000)]]) == [True, True]
    t.close()
    rep = inspect_dir(path, verify=True)
    assert rep["objects"] == 2 and rep["bytes"] == 3 * MiB + 1000 and rep["corrupt"] == 0
