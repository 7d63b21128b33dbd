"""Every miss has a reason: the store's bounded memory of departures, ``why_missing`` and its counters."""

from __future__ import annotations

import pytest
import torch

from tierkv import ConfigError, MissReason, TieredStore, chunk_keys
from tierkv.engine.departures import DEFAULT_MISS_MEMORY, Departures

CHUNK = 4096


def chunk(i: int) -> torch.Tensor:
    return torch.full((CHUNK,), i % 251, dtype=torch.uint8)


def keys_of(n: int, salt: str = "") -> list[str]:
    return chunk_keys(list(range(n * 4)), 4, namespace=salt)


def dram_store(slots: int = 4, **extra) -> TieredStore:
    return TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": slots * CHUNK, "eviction": "lru"}],
                                    **extra})


def test_the_reasons_are_exactly_the_named_words():
    assert [str(r) for r in MissReason] == ["never_stored", "evicted", "rejected", "corrupt", "audit_failed",
                                             "lease_expired", "unavailable", "other_namespace"]
    assert MissReason("evicted") is MissReason.EVICTED and MissReason.EVICTED == "evicted"


def test_an_evicted_key_names_its_tier_policy_and_age():
    # put 6 chunks into a 4-slot dram tier under lru -> the first two leave the store, evicted by dram's lru
    keys = keys_of(6)
    with dram_store() as store:
        for i, k in enumerate(keys):
            assert store.put([k], [chunk(i)]) == [True]
        assert store.locate(keys[:2]) == [None, None]
        assert store.why_missing(keys[:2]) == [MissReason.EVICTED, MissReason.EVICTED]
        dep = store.departures(keys[:2])[0]
        assert dep is not None and dep.reason is MissReason.EVICTED
        assert (dep.tier, dep.policy) == ("dram", "lru")
        assert 0 <= dep.age() < 60
        by_reason = store.stats()["total"]["misses_by_reason"]
        assert by_reason["evicted"] == 2
        assert set(by_reason) == {str(r) for r in MissReason}


def test_a_demoted_key_has_not_left_the_store(tmp_path):
    # hbm (2 slots) -> dram (8 slots): what hbm evicts is demoted, not departed; what dram then evicts departs
    keys = keys_of(12)
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": 2 * CHUNK},
                     {"medium": "dram", "capacity": 8 * CHUNK, "eviction": "fifo"}]}
    with TieredStore.from_config(cfg) as store:
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        present = store.locate(keys)
        gone = [k for k, t in zip(keys, present) if t is None]
        kept = [k for k, t in zip(keys, present) if t is not None]
        assert gone and kept
        assert {d.tier for d in store.departures(gone)} == {"dram"}
        assert {d.policy for d in store.departures(gone)} == {"fifo"}
        assert store.departures(kept) == [None] * len(kept)


def test_a_key_no_tier_admitted_is_rejected():
    keys = keys_of(2)
    cfg = {"tiers": [{"medium": "dram", "capacity": "1MiB", "admission": {"policy": "size", "max_bytes": 1024}}]}
    with TieredStore.from_config(cfg) as store:
        assert store.put(keys[:1], [chunk(0)]) == [False]
        assert store.why_missing(keys) == [MissReason.REJECTED, MissReason.NEVER_STORED]
        assert store.departures(keys[:1])[0].tier is None
        assert store.stats()["total"]["misses_by_reason"]["rejected"] == 1


def test_a_key_never_put_is_never_stored():
    with dram_store() as store:
        assert store.why_missing(keys_of(3)) == [MissReason.NEVER_STORED] * 3
        assert store.stats()["total"]["misses_by_reason"]["never_stored"] == 3


def test_memory_is_bounded_the_oldest_departure_is_pushed_out():
    # miss_memory 3: evict 3 keys (remembered), then a fourth pushes out the first -> never_stored
    keys = keys_of(8)
    with dram_store(slots=4, miss_memory=3) as store:
        for i, k in enumerate(keys[:7]):
            store.put([k], [chunk(i)])
        assert store.why_missing(keys[:3], count=False) == [MissReason.EVICTED] * 3
        store.put([keys[7]], [chunk(7)])  # the N+1-th departure
        assert store.why_missing(keys[:4], count=False) == [MissReason.NEVER_STORED] + [MissReason.EVICTED] * 3
        total = store.stats()["total"]
        assert (total["miss_memory"], total["miss_memory_used"]) == (3, 3)
        assert total["misses_by_reason"]["evicted"] == 0  # (count=False: not counted)


def test_bounded_memory_trims_inside_a_batch_and_keeps_newer_records():
    mem = Departures(5)
    mem.record(["a", "b", "c"], MissReason.EVICTED, "dram", "lru")
    mem.record(["a"], MissReason.CORRUPT, "ssd")  # a's newer record
    mem.record(["d", "e", "f"], MissReason.REJECTED)  # pushes out the first two places ("a" then "b")
    assert len(mem) == 5
    assert mem.explain(["a", "b", "c", "d"], MissReason.NEVER_STORED) == [
        MissReason.CORRUPT, MissReason.NEVER_STORED, MissReason.EVICTED, MissReason.REJECTED]
    mem.record(list("uvwxyz"), MissReason.EVICTED)  # a batch larger than the memory: its last 5 stay
    assert len(mem) == 5 and mem.recall(["a", "u", "v"]) == [None, None, mem.recall(["v"])[0]]
    assert mem.recall(["v"])[0] is not None
    assert Departures(0).explain(["a"], MissReason.NEVER_STORED) == [MissReason.NEVER_STORED]


def test_remove_with_a_reason_records_it_and_a_plain_remove_forgets():
    keys = keys_of(3)
    with dram_store(slots=8) as store:
        store.put(keys, [chunk(i) for i in range(3)])
        store.remove(keys[:1], reason=MissReason.AUDIT_FAILED)
        store.remove(keys[1:2], reason="lease_expired")
        assert store.locate(keys[:2]) == [None, None]
        assert store.why_missing(keys[:2]) == [MissReason.AUDIT_FAILED, MissReason.LEASE_EXPIRED]
        store.remove(keys[:1])  # deliberate: no miss reason, the memory forgets
        assert store.why_missing(keys[:1]) == [MissReason.NEVER_STORED]
        with pytest.raises(ValueError, match="reason must be a MissReason"):
            store.remove(keys[2:], reason="gone")
        assert store.locate(keys[2:]) == ["dram"]  # (a bad reason removes nothing)


def test_an_unavailable_tier_explains_what_is_not_remembered():
    keys = keys_of(1)
    with dram_store() as store:
        store.levels[0].tier._closed = True  # the medium says it cannot serve
        try:
            assert store.why_missing(keys) == [MissReason.UNAVAILABLE]
            assert store.put(keys, [chunk(0)]) == [False]
            assert store.departures(keys)[0].reason is MissReason.UNAVAILABLE
        finally:
            store.levels[0].tier._closed = False


def test_miss_memory_option_is_checked():
    with dram_store() as store:
        assert store.stats()["total"]["miss_memory"] == DEFAULT_MISS_MEMORY
    with pytest.raises(ConfigError, match="miss_memory"):
        dram_store(miss_memory=-1)
    with pytest.raises(ConfigError, match="miss_memory"):
        dram_store(miss_memory="many")


def test_a_get_miss_is_counted_by_reason():
    keys = keys_of(6)
    with dram_store() as store:
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        out = [torch.empty(CHUNK, dtype=torch.uint8) for _ in keys]
        assert store.get(keys, out) == [False, False, True, True, True, True]
        assert store.stats()["total"]["misses_by_reason"]["evicted"] == 2


def test_metrics_exposition_has_the_reason_label():
    from prometheus_client import CollectorRegistry, generate_latest

    from tierkv.metrics import register

    keys = keys_of(6)
    with dram_store() as store:
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        store.why_missing(keys[:3])  # 2 evicted, 1 still there (answered from memory: never_stored)
        reg = CollectorRegistry()
        register(store, reg)
        text = generate_latest(reg).decode()
    assert 'tierkv_misses_by_reason_total{reason="evicted"} 2.0' in text
    assert 'tierkv_misses_by_reason_total{reason="never_stored"} 1.0' in text
    assert 'tierkv_misses_by_reason_total{reason="other_namespace"} 0.0' in text
    assert "tierkv_misses_total 0.0" in text  # (the gets' own miss counter stays beside it)


def test_trace_show_answers_why_a_request_recomputed(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tierkv.trace import TraceWriter

    path = tmp_path / "t.jsonl"
    w = TraceWriter(str(path), block_tokens=16)
    w.record([b"a", b"b"], input_length=40, request_id="other")
    w.record([b"a", b"b", b"c"], input_length=3000, request_id="req-7", miss_tokens=3000,
             miss_reasons={"evicted": 2048, "never_stored": 952})
    w.close()
    exe = str(Path(sys.executable).parent / "tierkv")
    r = subprocess.run([exe, "trace", "show", str(path), "--request", "req-7"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "3000 tokens not served" in r.stdout
    assert [line.split() for line in r.stdout.splitlines()[1:]] == [["evicted", "2048", "tokens"],
                                                                    ["never_stored", "952", "tokens"]]
    r = subprocess.run([exe, "trace", "show", str(path), "--request", "req-7", "--json"], capture_output=True,
                       text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert doc["requests"][0]["miss_reasons"] == {"evicted": 2048, "never_stored": 952}
    r = subprocess.run([exe, "trace", "show", str(path), "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(r.stdout)["miss_tokens_by_reason"] == {"evicted": 2048, "never_stored": 952}
    r = subprocess.run([exe, "trace", "show", str(path), "--request", "nope"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "no request 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_a_corrupt_copy_dropped_is_explained_as_corrupt():
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB", "verify": "always"}]}) as store:
        keys = keys_of(1)
        store.put(keys, [chunk(1)])
        lvl = store.levels[0]
        with store._chain.lock:
            views = lvl.tier.views_at(lvl.codes(keys))
        views[0][0][5] ^= 1  # a bit flipped behind the store's back
        assert store.get(keys, [torch.empty(CHUNK, dtype=torch.uint8)]) == [False]
        assert store.why_missing(keys, count=False) == [MissReason.CORRUPT]
        assert store.departures(keys)[0].tier == "dram"
        assert store.stats()["total"]["misses_by_reason"]["corrupt"] == 1  # (counted by the get's miss)


def test_a_chunk_the_audit_dropped_is_explained_as_audit_failed():
    from tierkv.adapters.vllm.audit import Auditor
    from tierkv.outcome import PutOutcome

    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB"}]}) as store:
        keys = keys_of(2)
        stored = [torch.full((64,), 1.0), torch.full((64,), 2.0)]
        store.put(keys, stored)
        t = Auditor(0.0).check(store, keys, [stored[0], stored[1] + 1], [PutOutcome.PRESENT] * 2, [0, 1],
                               layer="L0", dtype=torch.float32)
        assert t.mismatches == 1 and store.contains(keys) == [True, False]
        assert store.why_missing(keys[1:]) == [MissReason.AUDIT_FAILED]
