"""Every path out of a lookup's lease (adapters/vllm/leases.py), without an engine.

A real store and KV cache tensors on the worker side; the scheduler asks the
worker directly (as when both share a process) with vLLM's requests and outputs as
plain objects.  Each test takes a lease through a lookup and checks that one path
releases it: the load done (in the step, between steps), the load failed, the
request finished or aborted before its load, preempted, no blocks allocated for
the hit, a new lookup of it, the deadline (counted), the worker's shutdown and the
store's close.  ``leases_active`` in the store's stats says what is still held.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

import torch

from tierkv import ConfigError, TieredStore
from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard, parse_options
from tierkv.adapters.vllm.scheduler import TierKVScheduler
from tierkv.adapters.vllm.service import ProbeRequest
from tierkv.adapters.vllm.worker import TierKVWorker

BS = 16
LAYERS = ("l0", "l1")
NB = 12
N = 4  # blocks of each request's stored prefix


class _Gets:
    """The real store; gets can be told to raise once, or to wait for ``gate``."""

    def __init__(self, store):
        self._store = store
        self.raise_next = False
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self._store, name)

    #: keys removed (as evicted) just before the next lease: an eviction between a probe's locate and its lease
    evict_before_lease: list[str] = []

    def lease(self, keys, ttl_s):
        gone, self.evict_before_lease = self.evict_before_lease, []
        if gone:
            self._store.remove(gone, reason="evicted")
        return self._store.lease(keys, ttl_s)

    def get(self, keys, outs):
        assert self.gate.wait(10)
        if self.raise_next:
            self.raise_next = False
            raise OSError("injected")
        return self._store.get(keys, outs)


def _rig(capacity="64MiB", **opts):
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": capacity, "eviction": "lru"}]})
    gets = _Gets(store)
    info = EngineInfo(block_size=BS, layers=LAYERS, num_blocks=NB, shard=kv_shard(0, 1, 2), namespaces={0: "ns"})
    options = ConnectorOptions(chunk_tokens=BS, **{"audit_rate": 0.0, **opts})
    w = TierKVWorker(options, info, gets, release=lambda s: None, serve=False)
    caches = {n: torch.zeros(NB, 2, BS, 8) for n in LAYERS}
    w.register_kv_caches(caches)
    s = TierKVScheduler(options, info, ask=lambda rank, req: w.probe(req))
    ref = {n: torch.randn(NB, 2, BS, 8) for n in LAYERS}
    return SimpleNamespace(w=w, s=s, store=store, gets=gets, caches=caches, ref=ref)


@contextlib.contextmanager
def _rigged(capacity="64MiB", **opts):
    """A rig (``_rig``) shut down and closed however the test leaves it."""
    r = _rig(capacity, **opts)
    try:
        yield r
    finally:
        r.w.shutdown()
        r.store.close()


@pytest.fixture
def rig():
    with _rigged() as r:
        yield r


def _assert_loaded(r) -> None:
    """The four blocks stored from ``r.ref``'s blocks 0-3 were loaded into the cache's blocks 5-8, every layer."""
    for name in LAYERS:
        assert torch.equal(r.caches[name][5:9], r.ref[name][0:4])


def _request(rid: str, blocks: int = N):
    hashes = [bytes([ord(rid[-1]), i]) * 16 for i in range(blocks + 1)]
    return SimpleNamespace(request_id=rid, num_tokens=blocks * BS + 3, num_prompt_tokens=blocks * BS + 3,
                           block_hashes=hashes, cache_salt=None)


def _store_prefix(r, req) -> None:
    for li, name in enumerate(LAYERS):
        keys = r.w.keys.keys_of(li, [bytes(h) for h in req.block_hashes[:N]], None)
        r.store.put(keys, [[r.ref[name][v].contiguous()] for v in range(N)])


def _active(r) -> int:
    return r.store.stats()["total"]["leases_active"]


def _lookup(r, rid: str = "r"):
    req = _request(rid)
    _store_prefix(r, req)
    before = r.w.leases.held()
    hit, _ = r.s.get_num_new_matched_tokens(req, 0)
    assert hit == N * BS
    assert r.w.leases.held() == before | {rid} and _active(r) == len(before) + 1
    return req


def _alloc(r, req, ids=(5, 6, 7, 8, 9), tokens=N * BS):
    r.s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(ids),)), tokens)


def _sched_output(new=(), preempted=()):
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens={}, preempted_req_ids=set(preempted))


def _step(r, out=None, finished=frozenset()):
    """One engine step: the scheduler's plan, then the worker's hooks as vLLM calls them."""
    meta = r.s.build_connector_meta(out or _sched_output())
    r.w.bind_metadata(meta)
    r.w.start_load_kv()
    r.w.wait_for_save()
    _, recving = r.w.get_finished(set(finished))
    errors = r.w.get_block_ids_with_load_errors()
    r.w.clear_metadata()
    return meta, recving or set(), errors


def _until_reported(r, rid):
    errors: set[int] = set()
    for _ in range(2000):
        _, recving, errs = _step(r)
        errors |= errs
        if rid in recving:
            return errors
        time.sleep(0.005)
    raise AssertionError(f"{rid} never reported")


def _scheduled(req, ids=(5, 6, 7, 8, 9)):
    return SimpleNamespace(req_id=req.request_id, block_ids=(list(ids),), num_computed_tokens=N * BS)


def test_a_load_in_the_step_releases_its_lease():
    with _rigged(load_async=False) as r:
        req = _lookup(r)
        _alloc(r, req)
        _, _, errors = _step(r, _sched_output(new=[_scheduled(req)]))
        assert errors == set() and _active(r) == 0
        _assert_loaded(r)
        assert r.w.totals.data["leases"] == 1 and r.w.totals.data["lease_expired"] == 0


def test_a_load_in_the_step_that_fails_releases_its_lease():
    with _rigged(load_async=False) as r:
        req = _lookup(r)
        _alloc(r, req)
        r.gets.raise_next = True
        _, _, errors = _step(r, _sched_output(new=[_scheduled(req)]))
        assert errors == {5, 6, 7, 8} and _active(r) == 0


@pytest.mark.parametrize("fail", [False, True])
def test_a_load_between_steps_releases_its_lease_done_or_failed(fail):
    with _rigged(load_async=True) as r:
        req = _lookup(r)
        _alloc(r, req)
        r.gets.raise_next = fail
        errors = _until_reported(r, "r")
        assert errors == ({5, 6, 7, 8} if fail else set())
        assert _active(r) == 0


def test_finished_or_aborted_before_its_load_the_scheduler_releases_it(rig):
    req = _lookup(rig)
    rig.s.request_finished(req)  # aborted while waiting: no blocks, no load
    meta, _, _ = _step(rig)
    assert meta.lease_releases == {"r"} and _active(rig) == 0


def test_finished_or_aborted_the_worker_releases_it_from_vllms_finished_ids(rig):
    _lookup(rig)
    rig.w.get_finished({"r"})
    assert _active(rig) == 0


def test_preempted_releases_it(rig):
    req = _lookup(rig)
    _alloc(rig, req)
    meta, _, _ = _step(rig, _sched_output(preempted=["r"]))
    assert "r" in meta.preempted and _active(rig) == 0


def test_no_blocks_for_the_hit_releases_it(rig):
    req = _lookup(rig)
    _alloc(rig, req, tokens=0)  # vLLM allocated without the external tokens
    meta, _, _ = _step(rig)
    assert meta.lease_releases == {"r"} and _active(rig) == 0


def test_a_new_lookup_of_the_request_replaces_its_lease(rig):
    req = _lookup(rig)
    rig.s.get_num_new_matched_tokens(req, 0)  # (vLLM could not allocate: it asks again next step)
    t = rig.store.stats()["total"]
    assert t["leases"] == 2 and t["leases_active"] == 1 and t["leases_released"] == 1


def test_a_lease_past_its_deadline_is_counted_and_its_load_fails_honestly():
    # a tier that holds the prefix and little more: a put after the deadline evicts the leased chunks
    with _rigged(capacity="16KiB", load_async=True, lease_timeout_s=0.05) as r:
        req = _lookup(r)
        _alloc(r, req)
        deadline = time.monotonic() + 10
        while r.store.stats()["total"]["lease_expired"] == 0:  # (stats() releases a lease past its deadline)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        block = r.ref[LAYERS[0]][0].contiguous()
        r.store.put([f"other{i}" for i in range(64)], [[block]] * 64)  # four times the tier
        assert not all(r.store.contains(r.w.keys.keys_of(0, [bytes(h) for h in req.block_hashes[:N]], None)))
        errors = _until_reported(r, "r")
        assert errors  # the chunks went: a counted failure, recomputed, never wrong bytes
        assert r.w.totals.data["lease_expired"] == 1 and r.w.totals.data["load_errors"] > 0
        assert _active(r) == 0


def test_the_workers_shutdown_releases_every_lease(rig):
    _lookup(rig)
    _lookup(rig, "q")
    assert _active(rig) == 2
    rig.w.shutdown()
    assert _active(rig) == 0


def test_the_stores_close_releases_every_lease(rig):
    _lookup(rig)
    rig.store.close()
    assert not rig.store.levels[0].pinned
    rig.w.get_finished({"r"})  # the worker letting go afterwards is harmless


def test_leases_off_hold_nothing():
    with _rigged(lease_timeout_s=0) as r:
        req = _request("r")
        _store_prefix(r, req)
        assert r.s.get_num_new_matched_tokens(req, 0)[0] == N * BS
        assert _active(r) == 0 and r.store.stats()["total"]["leases"] == 0
        ans = r.w.probe(ProbeRequest([bytes(h) for h in req.block_hashes], 0, None, "r"))
        assert ans.reach == N and ans.leased == 0


def test_a_probe_leases_every_layer_of_the_chunks_it_reports(rig):
    req = _request("r")
    _store_prefix(rig, req)
    ans = rig.w.probe(ProbeRequest([bytes(h) for h in req.block_hashes], 0, None, "r"))
    assert ans.reach == N and ans.leased == N * len(LAYERS)
    pinned = set(rig.store.levels[0].pinned)
    want = {k for li in range(len(LAYERS)) for k in rig.w.keys.keys_of(li, [bytes(h) for h in
                                                                          req.block_hashes[:N]], None)}
    assert pinned == want


@pytest.mark.parametrize("value", ["5", -1, True, float("inf"), 7200])
def test_lease_timeout_s_is_typed(value):
    with pytest.raises(ConfigError, match="lease_timeout_s"):
        parse_options({"lease_timeout_s": value})
    assert parse_options({}).lease_timeout_s == 30.0
    assert parse_options({"lease_timeout_s": 0}).lease_timeout_s == 0.0


def test_a_chunk_evicted_between_the_probes_locate_and_its_lease_ends_the_reach():
    # the prefix is stored in both layers; block 2 of the second layer is evicted after the probe located it and
    # before its lease: the hit ends at block 2, the leases of blocks 2..3 are let go, and the load reads only
    # what the lease holds (no block fails)
    with _rigged(load_async=False) as r:
        req = _request("r")
        _store_prefix(r, req)
        hashes = [bytes(h) for h in req.block_hashes]
        r.gets.evict_before_lease = r.w.keys.keys_of(1, hashes[2:3], None)
        ans = r.w.probe(ProbeRequest(hashes, 0, None, "r"))
        assert ans.reach == 2 and ans.leased == 2 * len(LAYERS) and len(ans.where) == 2
        # blocks 2 and 3 cut (evicted), block 4 never stored
        assert ans.missed == {"evicted": 2, "never_stored": 1}
        want = {k for li in range(len(LAYERS)) for k in r.w.keys.keys_of(li, hashes[:2], None)}
        assert set(r.store.levels[0].pinned) == want
        # through the scheduler: the hit is the two blocks the lease holds, and its load fails none
        # (block 1 of the first layer goes this time)
        r.gets.evict_before_lease = r.w.keys.keys_of(0, hashes[1:2], None)
        hit, _ = r.s.get_num_new_matched_tokens(req, 0)
        assert hit == BS and _active(r) == 1
        _alloc(r, req, ids=(5,), tokens=hit)
        scheduled = SimpleNamespace(req_id="r", block_ids=([5],), num_computed_tokens=hit)
        _, _, errors = _step(r, _sched_output(new=[scheduled]))
        assert errors == set() and _active(r) == 0
        for name in LAYERS:
            assert torch.equal(r.caches[name][5], r.ref[name][0])
        t = r.w.totals.data
        assert t["lease_cuts"] == 2 and t["load_errors"] == 0


def test_a_chunk_only_a_lease_cannot_pin_but_the_store_still_holds_stays_in_the_reach(rig):
    # a key the lease leaves unheld that the store still holds (a shared pool's, or one being written) is no
    # eviction: the reach stands
    req = _request("r")
    _store_prefix(rig, req)
    hashes = [bytes(h) for h in req.block_hashes]
    real = rig.store.lease

    def lease(keys, ttl_s):
        got = real(keys, ttl_s)
        got.unheld = list(keys[:1])  # (as a pool's object would be)
        return got

    rig.gets.lease = lease
    ans = rig.w.probe(ProbeRequest(hashes, 0, None, "r"))
    assert ans.reach == N and rig.w.totals.data.get("lease_cuts", 0) == 0


# ---- one resolve per hit: the load reads the probe's plan -------------------------------------------------
class _CountingLocates:
    """Counts the store's ``locate`` calls (everything else is the rig's store)."""

    def __init__(self, inner):
        self._inner = inner
        self.locates = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def locate(self, keys):
        self.locates += 1
        return self._inner.locate(keys)


@pytest.mark.parametrize("load_async", [False, True])
def test_a_load_reads_its_probes_plan_and_locates_nothing(load_async):
    with _rigged(load_async=load_async) as r:
        req = _lookup(r)
        plan = r.w.leases.plans(["r"])["r"]
        assert plan.chunks == [(b, b) for b in range(N)]
        assert set(plan.lease_keys()) == set(r.store.levels[0].pinned)
        _alloc(r, req)
        counting = _CountingLocates(r.w.store)
        r.w.store = counting
        if load_async:
            errors = _until_reported(r, "r")
        else:
            _, _, errors = _step(r, _sched_output(new=[_scheduled(req)]))
        assert errors == set() and counting.locates == 0 and _active(r) == 0
        _assert_loaded(r)


def test_a_load_no_plan_fits_locates_its_chunks():
    # the request was looked up again from another block: the plan held is not the load's, which locates once
    with _rigged(load_async=False) as r:
        req = _lookup(r)
        _alloc(r, req)
        hashes = [bytes(h) for h in req.block_hashes]
        r.w.probe(ProbeRequest(hashes, 1, None, "r"))  # (a plan from block 1: the load starts at 0)
        counting = _CountingLocates(r.w.store)
        r.w.store = counting
        _, _, errors = _step(r, _sched_output(new=[_scheduled(req)]))
        assert errors == set() and counting.locates == 1 and _active(r) == 0
        _assert_loaded(r)


# ---- one owner, one release path: every exit, faults injected, ends the lease -----------------------------
def _broken_plan(*args, **kwargs):
    raise RuntimeError("injected")


def _exit_loaded(r, req):
    _alloc(r, req)
    _step(r, _sched_output(new=[_scheduled(req)]))


def _exit_load_raises(r, req):
    # the loader itself breaks (not the store): the job still settles and lets go
    _alloc(r, req)
    r.w._loader.plan = _broken_plan
    with pytest.raises(RuntimeError, match="injected"):
        _step(r, _sched_output(new=[_scheduled(req)]))


def _exit_async_load_raises(r, req):
    r.w._async_loader.start = _broken_plan
    _alloc(r, req)
    assert _until_reported(r, "r") == {5, 6, 7, 8}


def _exit_not_loaded(r, req):
    _alloc(r, req, tokens=0)
    _step(r)


def _exit_finished(r, req):
    r.w.get_finished({"r"})


def _exit_preempted(r, req):
    _alloc(r, req)
    _step(r, _sched_output(preempted=["r"]))


def _exit_replaced(r, req):
    r.w.probe(ProbeRequest([bytes(h) for h in req.block_hashes], N + 1, None, "r"))  # (finds nothing more)


def _exit_shutdown(r, req):
    r.w.shutdown()


@pytest.mark.parametrize("load_async,path,why", [
    (False, _exit_loaded, "loaded"),
    (False, _exit_load_raises, "loaded"),
    (True, _exit_async_load_raises, "loaded"),
    (False, _exit_not_loaded, "not_loaded"),
    (False, _exit_finished, "finished"),
    (False, _exit_preempted, "preempted"),
    (False, _exit_replaced, "replaced"),
    (True, _exit_shutdown, "shutdown"),
])
def test_every_exit_ends_the_lease_through_its_owner(load_async, path, why):
    from tierkv.adapters.vllm.leases import LeaseEnd

    with _rigged(load_async=load_async) as r:
        req = _lookup(r)
        path(r, req)
        assert _active(r) == 0 and r.w.leases.held() == set()
        assert r.w.leases.ends == {LeaseEnd(why): 1}
        assert r.store.stats()["total"]["leases_released"] == 1  # (released by the worker, once)
