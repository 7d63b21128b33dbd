"""Loads between engine steps (``load_async``): the background loader, the worker and scheduler sides.

No engine: a real store and KV cache tensors on the worker side, vLLM's requests and
outputs as plain objects on the scheduler side.  What is checked: a load is reported
finished exactly once, together with every block that failed for it (never a step
later); a request finished while its load is queued is never written, one whose
load is under way is reported only once the writing is over; shutdown skips what
is queued and waits for what runs; a failed load makes the request's next lookup a
miss.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

import torch

from tierkv import TieredStore
from tierkv.adapters.vllm.async_loading import AsyncLoads
from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
from tierkv.adapters.vllm.metadata import LoadSpec, TierKVConnectorMetadata
from tierkv.adapters.vllm.scheduler import TierKVScheduler
from tierkv.adapters.vllm.service import ProbeAnswer, ProbeRequest, TierPlace
from tierkv.adapters.vllm.worker import TierKVWorker

BS = 16
LAYERS = ("l0", "l1")
NB = 12


def _spec(rid: str, block_ids: list[int], start: int = 0) -> LoadSpec:
    hashes = [bytes([ord(rid[-1]), i]) * 16 for i in range(start + len(block_ids))]
    return LoadSpec(rid, start, block_ids, hashes[start:], None, start)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ---- AsyncLoads on its own ---------------------------------------------------------------
class _Job:
    def __init__(self, failed=()):
        self.failed_blocks = set(failed)


def test_finished_once_with_its_failed_blocks():
    ran = []

    def run(specs):
        ran.append([s.req_id for s in specs])
        return _Job(failed={specs[0].block_ids[-1]} if specs[0].req_id == "b" else ())

    a = AsyncLoads(run)
    a.submit([_spec("a", [1, 2])])
    a.submit([_spec("b", [3, 4]), _spec("c", [5])])
    assert a.wait_idle(10)
    done, failed = a.take_finished()
    assert done == {"a", "b", "c"} and failed == {4}
    assert a.take_finished() == (set(), set())  # reported once
    assert ran == [["a"], ["b"], ["c"]] and a.in_flight() == set()  # one request per load
    assert a.close(5)


def test_each_request_of_a_batch_is_reported_when_its_own_load_is_over():
    gate = threading.Event()
    ran = []

    def run(specs):
        ran.append(sorted({s.req_id for s in specs}))
        if specs[0].req_id == "b":
            assert gate.wait(10)
        return _Job(failed={3} if specs[0].req_id == "b" else ())

    a = AsyncLoads(run)
    # one step's batch: a's two specs load together, b's after them
    a.submit([_spec("a", [1]), _spec("b", [3, 4]), _spec("a", [2])])
    got: set = set()
    _wait(lambda: got.update(a.take_finished()[0]) or "a" in got)
    assert got == {"a"} and a.in_flight() == {"b"}  # a is out while b's load still runs
    gate.set()
    assert a.wait_idle(10)
    assert a.take_finished() == ({"b"}, {3})
    assert ran == [["a"], ["b"]]
    assert a.close(5)


def test_a_load_that_raises_fails_every_block_and_the_thread_goes_on():
    calls = []

    def run(specs):
        calls.append(specs[0].req_id)
        if specs[0].req_id == "a":
            raise OSError("medium down")
        return _Job()

    a = AsyncLoads(run)
    a.submit([_spec("a", [1, 2])])
    a.submit([_spec("b", [3])])
    assert a.wait_idle(10)
    assert a.take_finished() == ({"a", "b"}, {1, 2})
    assert calls == ["a", "b"]
    a.close(5)


def _gated_loads():
    """Loads whose runs record their requests (in ``ran``), set ``started`` and wait for ``gate`` (10 s at most):
    (the loads, gate, started, ran)."""
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def run(specs):
        ran.extend(s.req_id for s in specs)
        started.set()
        gate.wait(10)
        return _Job()

    return AsyncLoads(run), gate, started, ran


def test_cancelled_before_start_is_never_loaded_but_reported():
    a, gate, started, ran = _gated_loads()
    a.submit([_spec("a", [1])])
    assert started.wait(5)
    a.submit([_spec("b", [2]), _spec("c", [3])])
    a.cancel({"b", "zzz"})  # b is queued; zzz was never submitted
    # a runs: cancelling it does not report it before its writes are over
    a.cancel({"a"})
    assert a.take_finished() == (set(), set())
    gate.set()
    assert a.wait_idle(10)
    done, failed = a.take_finished()
    assert done == {"a", "b", "c"} and failed == set()
    assert ran == ["a", "c"]  # b's blocks were never written
    a.close(5)


def test_close_skips_the_queued_waits_for_the_running_and_fails_later_ones():
    a, gate, started, ran = _gated_loads()
    a.submit([_spec("a", [1]), _spec("d", [5])])
    assert started.wait(5)
    a.submit([_spec("b", [2, 3])])
    assert a.close(0.05) is False  # a is still being written
    threading.Timer(0.1, gate.set).start()
    assert a.close(10) is True
    a.submit([_spec("c", [4])])  # after close: fails at once, nothing runs
    done, failed = a.take_finished()
    # d, in a's batch but not started when close came, is skipped as the queued b is
    assert done == {"a", "b", "c", "d"} and failed == {2, 3, 4, 5}
    assert ran == ["a"]


# ---- the worker side ----------------------------------------------------------------------
class _GatedStore:
    """The real store; gets wait for ``gate`` (and can be told to raise)."""

    def __init__(self, store):
        self._store = store
        self.gate = threading.Event()
        self.gate.set()
        self.in_get = threading.Event()
        self.raise_next = False
        self.get_threads: list[str] = []
        self.got_keys: list[str] = []

    def __getattr__(self, name):
        return getattr(self._store, name)

    def get(self, keys, outs):
        self.get_threads.append(threading.current_thread().name)
        self.got_keys.extend(keys)
        self.in_get.set()
        assert self.gate.wait(10)
        if self.raise_next:
            self.raise_next = False
            raise OSError("injected")
        return self._store.get(keys, outs)


@pytest.fixture
def rig():
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    gated = _GatedStore(store)
    info = EngineInfo(block_size=BS, layers=LAYERS, num_blocks=NB, shard=kv_shard(0, 1, 2), namespaces={0: "ns"})
    w = TierKVWorker(ConnectorOptions(chunk_tokens=BS, load_async=True), info, gated, release=lambda s: None,
                     serve=False)
    caches = {n: torch.zeros(NB, 2, BS, 8) for n in LAYERS}
    w.register_kv_caches(caches)
    ref = {n: torch.randn(NB, 2, BS, 8) for n in LAYERS}
    yield SimpleNamespace(w=w, store=store, gated=gated, caches=caches, ref=ref)
    w.shutdown()
    store.close()


def _store_blocks(rig, spec: LoadSpec, values: list[int]) -> None:
    """Put block ``start+i`` of ``spec`` (one object per block) with the bytes of ref block ``values[i]``."""
    for li, name in enumerate(LAYERS):
        keys = rig.w.keys.keys_of(li, spec.block_hashes, None)
        rig.store.put(keys, [[rig.ref[name][v].contiguous()] for v in values])


def _step(w, async_loads=(), finished=frozenset()):
    """One engine step as vLLM runs it: bind, start_load_kv, wait_for_save, get_finished, errors."""
    w.bind_metadata(TierKVConnectorMetadata(async_loads=list(async_loads)))
    w.start_load_kv()
    w.wait_for_save()
    sending, recving = w.get_finished(set(finished))
    errors = w.get_block_ids_with_load_errors()
    w.clear_metadata()
    return recving or set(), errors


def _until_reported(w, rid: str, finished=frozenset()):
    errors: set[int] = set()
    for _ in range(2000):
        recving, errs = _step(w, finished=finished)
        errors |= errs
        if rid in recving:
            return errors
        time.sleep(0.005)
    raise AssertionError(f"{rid} never reported")


def test_worker_loads_between_steps_and_reports_in_finished_recving(rig):
    spec = _spec("a", [5, 6, 7])
    _store_blocks(rig, spec, [0, 1, 2])
    rig.gated.gate.clear()
    recving, errors = _step(rig.w, [spec])
    assert recving == set() and errors == set()  # the step did not wait for the load
    assert rig.gated.in_get.wait(5)
    rig.gated.gate.set()
    assert _until_reported(rig.w, "a") == set()
    for name in LAYERS:
        assert torch.equal(rig.caches[name][5:8], rig.ref[name][0:3])
    assert rig.gated.get_threads == ["tierkv-async-load"]
    assert rig.w.load_counts == {"sync": 0, "async": 1}
    t = rig.w.totals.data
    assert t["load_blocks"] == 3 and t["load_errors"] == 0 and t["load_bytes"] > 0


def test_worker_reports_failed_blocks_with_the_request(rig):
    # blocks 0-1 stored, block 2 missing (evicted since the lookup): 2 fails, the others load
    spec = _spec("b", [8, 9, 10])
    _store_blocks(rig, _spec("b", [8, 9]), [3, 4])
    recving, errors = _step(rig.w, [spec])
    assert recving <= {"b"}
    if "b" not in recving:  # (a load can be over within its own step: then it is reported there)
        errors |= _until_reported(rig.w, "b")
    assert errors == {10}
    assert torch.equal(rig.caches["l0"][8:10], rig.ref["l0"][3:5])
    # a medium that raises: every block of the request fails, reported in the same step as the request
    spec2 = _spec("c", [0, 1])
    _store_blocks(rig, spec2, [5, 6])
    rig.gated.raise_next = True
    recving, errors = _step(rig.w, [spec2])
    if "c" not in recving:
        errors |= _until_reported(rig.w, "c")
    assert errors == {0, 1}
    assert rig.w.totals.data["load_errors"] == 3


def test_request_finished_while_its_load_runs_keeps_its_blocks_until_reported(rig):
    spec = _spec("d", [2, 3])
    _store_blocks(rig, spec, [7, 8])
    rig.gated.gate.clear()
    _step(rig.w, [spec])
    assert rig.gated.in_get.wait(5)
    # vLLM aborts it: the load is being written, so it is not reported yet (vLLM keeps the blocks)
    for _ in range(5):
        recving, _ = _step(rig.w, finished={"d"})
        assert "d" not in recving
    rig.gated.gate.set()
    _until_reported(rig.w, "d")
    assert torch.equal(rig.caches["l1"][2:4], rig.ref["l1"][7:9])


def test_request_finished_before_its_load_starts_is_never_written(rig):
    first, second = _spec("e", [1]), _spec("f", [4, 5])
    _store_blocks(rig, first, [1])
    _store_blocks(rig, second, [2, 3])
    rig.gated.gate.clear()
    _step(rig.w, [first])
    assert rig.gated.in_get.wait(5)
    _step(rig.w, [second])  # queued behind e
    recving, _ = _step(rig.w, finished={"f"})  # f aborted before its load started
    rig.gated.gate.set()
    done = set(recving)
    for _ in range(2000):
        r, errs = _step(rig.w)
        done |= r
        assert not errs
        if done >= {"e", "f"}:
            break
        time.sleep(0.005)
    assert done >= {"e", "f"}
    keys_f = {k for li in range(len(LAYERS)) for k in rig.w.keys.keys_of(li, second.block_hashes, None)}
    assert not keys_f & set(rig.gated.got_keys)  # f was never read
    assert torch.count_nonzero(rig.caches["l0"][4:6]) == 0  # nor written


def test_shutdown_waits_for_the_running_load_and_fails_the_queued(rig):
    first, second = _spec("g", [1]), _spec("h", [2])
    _store_blocks(rig, first, [1])
    _store_blocks(rig, second, [2])
    rig.gated.gate.clear()
    _step(rig.w, [first])
    assert rig.gated.in_get.wait(5)
    _step(rig.w, [second])
    threading.Timer(0.2, rig.gated.gate.set).start()
    rig.w.shutdown()
    # g's get finished before the store was released; h never ran
    assert rig.w.store is None
    assert torch.equal(rig.caches["l0"][1], rig.ref["l0"][1])
    assert torch.count_nonzero(rig.caches["l0"][2]) == 0
    # a load after shutdown: reported at once, every block failed
    recving, errors = _step(rig.w, [_spec("i", [3])])
    assert "i" in recving and errors >= {2, 3}


# ---- the scheduler side ---------------------------------------------------------------------
def _scheduler(load_async, reach: int, where=("dram", "host"), **opts):
    def ask(rank, request):
        assert isinstance(request, ProbeRequest)
        lo, hi = request.local, len(request.hashes)
        n = max(0, min(hi, reach) - lo)
        tiers = where(request.hashes) if callable(where) else [where] * n
        return ProbeAnswer(n, min(lo, reach), [None if t is None else TierPlace(*t) for t in tiers[:n]])

    info = EngineInfo(block_size=BS, layers=LAYERS, num_blocks=NB, shard=kv_shard(0, 1, 2), namespaces={0: "ns"})
    return TierKVScheduler(ConnectorOptions(chunk_tokens=BS, load_async=load_async, **opts), info, ask=ask)


def _request(rid: str, blocks: int):
    return SimpleNamespace(request_id=rid, num_tokens=blocks * BS + 3, num_prompt_tokens=blocks * BS + 3,
                           block_hashes=[bytes([i]) * 8 for i in range(blocks)], cache_salt=None)


def _sched_output(new=(), preempted=()):
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens={}, preempted_req_ids=set(preempted))


def test_scheduler_async_hit_goes_out_at_once_and_a_failure_makes_the_next_lookup_a_miss():
    s = _scheduler(True, reach=4)
    req = _request("r", 4)
    assert s.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    s.update_state_after_alloc(req, blocks, 4 * BS)
    meta = s.build_connector_meta(_sched_output())  # the request is parked, not scheduled
    assert meta.loads == [] and [(x.req_id, x.start, x.block_ids) for x in meta.async_loads] == \
        [("r", 0, [10, 11, 12, 13])]
    assert s.build_connector_meta(_sched_output()).async_loads == []  # once
    # the workers report block 12 failed with the request: vLLM frees the blocks and looks again
    s.update_connector_output(SimpleNamespace(invalid_block_ids={12}, finished_recving={"r"}))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed, not the same load again
    assert s.get_num_new_matched_tokens(req, 0) == (4 * BS, True)  # a later lookup hits again
    # finished while parked: no saves were planned, vLLM alone holds the blocks until the report
    assert s.request_finished(req) == (False, None)


def test_scheduler_nothing_to_load_is_not_async_and_sync_mode_is_unchanged():
    s = _scheduler(True, reach=0)
    assert s.get_num_new_matched_tokens(_request("a", 3), 0) == (0, False)
    s = _scheduler(False, reach=3)
    req = _request("b", 3)
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 3 * BS)
    assert s.build_connector_meta(_sched_output()).async_loads == []  # waits to be scheduled


def test_scheduler_auto_loads_the_steps_first_memory_hit_in_the_step_and_parks_the_rest():
    s = _scheduler("auto", reach=4)
    a, b, c = _request("a", 4), _request("b", 4), _request("c", 4)
    assert s.get_num_new_matched_tokens(a, 0) == (4 * BS, False)  # the step's first hit: in the step
    assert s.get_num_new_matched_tokens(b, 0) == (4 * BS, True)  # the same step's next: between steps
    s.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 4 * BS)
    s.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([6, 7, 8, 9, 10],)), 4 * BS)
    new_a = SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=4 * BS)
    meta = s.build_connector_meta(_sched_output(new=[new_a]))
    assert [x.req_id for x in meta.loads] == ["a"] and [x.req_id for x in meta.async_loads] == ["b"]
    # a new step: its first hit loads in the step again
    assert s.get_num_new_matched_tokens(c, 0) == (4 * BS, False)
    # nothing to load is never parked, and does not use up the step's in-step load
    s.build_connector_meta(_sched_output())
    assert s.get_num_new_matched_tokens(_request("d", 0), 0) == (0, False)
    assert s.get_num_new_matched_tokens(c, 0) == (4 * BS, False)


@pytest.mark.parametrize("where", [
    ("ssd", "disk"),  # from disk: between steps
    ("mooncake", "remote"),
    lambda hashes: [("dram", "host")] * 3 + [("ssd", "disk")],  # one block from disk is enough
    lambda hashes: [("dram", "host")] * 3,  # a block whose tier is not known
])
def test_scheduler_auto_parks_a_hit_that_is_not_all_in_memory(where):
    s = _scheduler("auto", reach=4, where=where)
    assert s.get_num_new_matched_tokens(_request("a", 4), 0) == (4 * BS, True)


def test_scheduler_auto_parks_a_hit_longer_than_the_in_step_limit():
    s = _scheduler("auto", reach=4, load_inline_max_tokens=3 * BS)
    assert s.get_num_new_matched_tokens(_request("a", 4), 0) == (4 * BS, True)
    assert s.get_num_new_matched_tokens(_request("b", 3), 0) == (3 * BS, False)  # at the limit: in the step


@pytest.mark.parametrize("value", ["false", "true", "Auto", 1, 0, None])
def test_load_async_option_is_typed(value):
    from tierkv.adapters.vllm.config import parse_options
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match="load_async"):
        parse_options({"load_async": value})
    assert parse_options({"load_async": True}).load_async is True
    assert parse_options({"load_async": False}).load_async is False
    assert parse_options({"load_async": "auto"}).load_async == "auto"
    assert parse_options({}).load_async == "auto"


@pytest.mark.parametrize("extra, match", [
    ({"load_async": "auto", "load_inline_max_tokens": "4096"}, "expected an integer"),
    ({"load_async": "auto", "load_inline_max_tokens": -1}, "at least 0"),
    ({"load_async": True, "load_inline_max_tokens": 4096}, "needs"),
    ({"load_async": False, "load_inline_max_tokens": 4096}, "needs"),
])
def test_load_inline_max_tokens_is_typed_and_needs_auto(extra, match):
    from tierkv.adapters.vllm.config import parse_options
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match=f"load_inline_max_tokens.*{match}|{match}.*load_inline_max_tokens"):
        parse_options(extra)
    assert parse_options({"load_async": "auto", "load_inline_max_tokens": 0}).load_inline_max_tokens == 0
    assert parse_options({"load_inline_max_tokens": 512}).load_inline_max_tokens == 512  # (auto: the default)
