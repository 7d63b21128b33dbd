"""The connector's worker side: vLLM's worker hooks over the parts that do the work.

Objects
    A request's KV is stored in chunks of ``chunk_tokens`` (whole blocks; see
    chunks.py): one object per (chunk, layer, stored KV-head shard), named from
    vLLM's hash of the chunk's last block (layer_keys.py).  Full chunks are saved
    as they complete; the blocks after the last full chunk are saved as a shorter
    *tail* once the prompt is prefilled.  A rank that holds several stored KV-head
    shards of a layer (``kv_head_shards`` above the engine's own shards) keeps
    each as a *slice* of its own: a view of the layer's cache narrowed to those
    heads (paged.py, ``split_heads``), saved, probed and loaded as the parts do a
    layer (they index slices).

Parts (each its own module, each built here and nowhere else)
    ``Prober`` (probe.py) answers the scheduler's probes (service.py) on the lookup
    channel (lookup.py) and names the chunks a load reads; ``Loader`` (loading.py)
    runs a step's loads, ``AsyncLoads`` (async_loading.py) the loads between
    steps; ``Saver`` (saving.py) the save thread; ``WorkerCounters``
    (accounting.py) what they all moved.

Loads
    ``start_load_kv`` fills the step's planned blocks; a block that fails is
    reported by ``get_block_ids_with_load_errors`` and its request's saves from
    that block on are dropped, so vLLM recomputes it and nothing computed from
    bad KV reaches the store.  With ``load_async`` a hit is loaded on a
    background thread while vLLM keeps the request parked and steps the others;
    ``get_finished`` reports it (second set) in the same step as its failed
    blocks, and a request finished meanwhile keeps its blocks until then.

Saves
    ``save_kv_layer`` queues the layer's newly completed chunks for a background
    put; ``wait_for_save`` settles the step's loads, releases the saves they held
    back and (``save_wait``, the default) returns once the step's saves are in
    the store, so nothing is queued between steps and an engine killed between
    steps loses no save.  ``get_finished`` reports requests whose saves are done.

Ownership
    The worker owns its store reference (handed to ``release`` once, at
    ``shutdown``), its channel servers and its parts' threads; vLLM owns the KV
    cache.  ``shutdown`` is idempotent and may come from vLLM, a signal, the
    lifecycle channel or the exit of the interpreter: it drains (up to
    ``shutdown_timeout_s``), logs the totals, releases the store and closes the
    channels.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .accounting import WorkerCounters
from .async_loading import AsyncLoads
from .audit import Auditor
from .config import ConnectorOptions, EngineInfo
from .connector_stats import TierKVConnectorStats
from .kv_events import ChunkEvents, TierKVEvents
from .layer_keys import LayerKeys
from .leases import LeaseEnd, RequestLeases
from .load_mode import LoadMode
from .loading import Loader, LoadJob
from .lookup import ChannelServer, endpoint, sweep_stale_sockets
from .metadata import LoadSpec, TierKVConnectorMetadata
from .paged import PagedLayer, split_heads
from .probe import LoadPlan, Prober, cut_answer
from .prom import SnapshotClock, attach_store_snapshot, watch_store
from .saving import Saver
from .service import Channel, ProbeAnswer, ProbeRequest, ShutdownRequest

if TYPE_CHECKING:
    from tierkv.engine.leases import Lease
    from tierkv.store import TieredStore

#: requests whose first lookup a worker remembers (their misses are counted once)
_LOOKED_UP_MAX = 1 << 16

logger = logging.getLogger("vllm.tierkv.worker")


class TierKVWorker:
    """Worker-side logic of ``TierKVConnector`` (one per tensor-parallel rank).

    ``store`` is a ``TieredStore``; ``release(store)`` is called once at shutdown
    with that same store (default: ``store.flush()`` then ``store.close()``), even
    if ``worker.store`` was replaced meanwhile.  ``serve``: answer the scheduler on
    this rank's lookup and lifecycle channels.
    """

    def __init__(self, options: ConnectorOptions, info: EngineInfo, store: TieredStore, *,
                 release: Callable[[TieredStore], None] | None = None, serve: bool = True) -> None:
        self.options = options
        self.info = info
        #: the store every part uses (read per call: a caller may wrap it); None once shut down
        self.store: TieredStore | None = store
        self._owned: TieredStore | None = store
        self._release = release or _flush_and_close
        watch_store(store)  # latency histograms for vLLM's /metrics
        self._snapshots = SnapshotClock()
        self.shard = info.shard
        self.tp_rank = info.tp_rank
        chunk_blocks = max(1, options.chunk_tokens // info.block_size)
        # the parts work on slices (one per layer, or per layer and stored KV-head shard this rank holds)
        layers = list(info.slice_names)
        n = info.slices_per_layer
        #: each layer's slices, in order
        self._slices_of = {name: tuple(range(i * n, (i + 1) * n)) for i, name in enumerate(info.layers)}

        def slice_group(s: int) -> int:
            return info.group_of(s // n)

        group_of = info.group_of if n == 1 else slice_group
        state_slices = tuple(i * n + k for i in info.state_layers for k in range(n))
        tiers = store.tier_info()
        self.keys = LayerKeys(info)
        self._slice_names = layers
        self.counters = WorkerCounters()
        self.prober = Prober(self.keys, chunk_blocks, lambda: self.store, {t["name"]: t["locality"] for t in tiers},
                             state_slices=state_slices)
        #: layers of recurrent-state groups: vLLM calls no per-layer hook for them, so their saves are
        #: copied out at the step's end (wait_for_save), before vLLM may hand their blocks to another request
        self._state_layers = [info.layers[i] for i in info.state_layers]
        #: what lookups found and leased, and the plans their loads read (leases.py: the one owner of the
        #: worker's leases); off with lease_timeout_s 0
        self.leases = RequestLeases()
        self._looked_up: OrderedDict[str, None] = OrderedDict()  # requests whose misses were counted
        self._paged: dict[str, PagedLayer] = {}
        # replicas of a shard split the writes only when every tier is shared between
        # processes; with private tiers each replica must hold what it will load
        split = self.shard.replicas > 1 and all(t["shared"] for t in tiers)
        #: chunks that became stored, for vLLM's KV events (None: vLLM publishes no events)
        self.events: ChunkEvents | None = ChunkEvents() if info.kv_events else None
        self.saver = Saver(keys=self.keys, layers=layers, paged=self._paged, chunk_blocks=chunk_blocks, shard=self.shard,
                           split_writes=split, store=lambda: self.store, counters=self.counters,
                           group_of=group_of, num_groups=info.num_groups,
                           auditor=Auditor(options.audit_tolerance), state_groups=info.state_groups,
                           tenant=options.namespace, events=self.events)
        if self.events is not None:
            store.add_removal_listener(self.events.on_removed)

        def loader() -> Loader:
            return Loader(slices=layers, paged=self._paged, block_size=info.block_size, store=lambda: self.store,
                          locate=self.prober.locate, slice_keys=self.keys.keys, tp_rank=info.tp_rank,
                          tp_size=info.tp_size, group_of=group_of, num_groups=info.num_groups,
                          state_groups=info.state_groups)

        self._loader = loader()
        self._loader.layerwise = options.layerwise is True  # "auto" is settled in register_kv_caches
        # loads between steps (load_async): a loader of their own (its discard buffers are
        # not shared with the engine thread's loads), every layer in one get
        self._async_loader = loader()
        self._async = AsyncLoads(self._start_async_job, on_done=self._count_async_load)
        self._metadata: TierKVConnectorMetadata | None = None
        #: when the step's metadata came, and the tokens the step computes
        self._step_began: tuple[float, int] = (0.0, 0)
        self.load_job: LoadJob | None = None
        #: requests whose load failed, to report in vLLM's failed_recving (several KV cache groups)
        self.failed_recving: set[str] = set()
        self._to_log: set[str] = set()
        self._closing = threading.Lock()
        self.closed = False
        #: told ("totals", reduced totals) when they change, ("logged", None) once the totals line is
        #: out and ("clean", None) when the shutdown is complete (see lifecycle.Watcher)
        self.report: Callable[[str, dict | None], None] | None = None
        self._servers: list[ChannelServer] = []
        if serve:
            sweep_stale_sockets()  # file sockets of killed predecessors
            for channel, handler in ((Channel.LOOKUP, self.probe), (Channel.LIFECYCLE, self._on_shutdown_request)):
                path, key = endpoint(info.engine_id, info.dp_rank, info.tp_rank, channel)
                self._servers.append(ChannelServer(path, key, channel, handler))

    # ---- what tests and tools read -------------------------------------------------
    @property
    def layerwise(self) -> bool:
        return self._loader.layerwise

    @property
    def socket_paths(self) -> list[str]:
        """The addresses of this worker's channels (none when it does not serve)."""
        return [s.path for s in self._servers]

    @property
    def totals(self) -> TierKVConnectorStats:
        return self.counters.totals

    @property
    def request_records(self) -> Any:
        return self.counters.request_records

    @property
    def load_counts(self) -> dict[LoadMode, int]:
        return self.counters.load_counts

    @property
    def load_trace(self) -> Any:
        return self.counters.load_trace

    # ---- the channels ---------------------------------------------------------------
    def probe(self, request: ProbeRequest) -> ProbeAnswer:
        """The scheduler's question about one request (the lookup channel), answered in one pass."""
        if self.closed:
            raise RuntimeError("the connector's worker is shut down")
        ttl = self.options.lease_timeout_s
        leasing = request.req_id is not None and bool(ttl)
        # a request's misses are counted by reason once, at its first lookup (the scheduler asks again while
        # the request waits)
        answer, plan = self.prober.probe_plan(request, count_misses=self._first_lookup(request.req_id),
                                              plan=leasing)
        if not leasing or plan is None:
            return answer
        answer, plan, lease = self._lease_reach(answer, plan, ttl)
        # (held by the one owner of leases; a lookup holding nothing ends an earlier lookup's lease)
        self.leases.hold(request.req_id, lease, plan)  # type: ignore[arg-type]  # (leasing: an id)
        if lease is None:
            return answer
        return ProbeAnswer(answer.reach, answer.held, answer.where, lease.held, answer.missed)

    def _lease_reach(self, answer: ProbeAnswer, plan: LoadPlan,
                     ttl: float) -> tuple[ProbeAnswer, LoadPlan, Lease | None]:
        """Lease the objects of ``plan`` (``answer``'s reach); the reach and the plan end at the first chunk (of
        any slice) the lease could not hold because the store lost it since the probe looked (an eviction in
        between), and what was leased past that is let go.  Keys a lease leaves unheld but the store still
        holds (a shared pool's) stay in the reach.  Returns the answer, the plan its lease holds and the lease
        (None: nothing to hold)."""
        store = self.store
        if store is None:
            raise RuntimeError("the connector's worker is shut down")
        while plan.chunks:
            lease = store.lease(plan.lease_keys(), ttl)
            if not lease.unheld:
                return answer, plan, lease
            unheld = list(lease.unheld)
            gone = [k for k, t in zip(unheld, store.locate(unheld)) if t is None]
            cut = plan.cut_at(gone) if gone else None
            if cut is None:
                return answer, plan, lease
            lease.release()  # (never held by the owner: this probe's own, cut short)
            answer = cut_answer(answer, cut, str(store.why_missing(gone[:1], count=False)[0]))
            self.counters.add_probe_cut(len(gone))
            plan = plan.before(cut)
        return answer, plan, None

    def _first_lookup(self, req_id: str | None) -> bool:
        """Whether no lookup of ``req_id`` was seen yet (bounded memory; a request without an id: yes)."""
        if req_id is None:
            return True
        seen = self._looked_up
        if req_id in seen:
            return False
        seen[req_id] = None
        if len(seen) > _LOOKED_UP_MAX:
            seen.popitem(last=False)
        return True

    def _on_shutdown_request(self, request: ShutdownRequest) -> None:
        self.shutdown()

    # ---- vLLM's worker hooks --------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        info = self.info
        n, names = info.slices_per_layer, info.slice_names
        for i, name in enumerate(info.layers):
            t = kv_caches.get(name)
            if t is None:
                raise ValueError(f"TierKVConnector: no KV cache tensor for layer {name!r}")
            paged = PagedLayer.wrap(t, info.num_blocks, info.block_size)
            # several stored KV-head shards on this rank: a view of each shard's heads
            for k, part in enumerate(split_heads(paged, info.rank_heads_of(i), n)):
                self._paged[names[i * n + k]] = part
        for paged in self._paged.values():
            paged.prepare()  # views of the cache made here, outside the engine's inference mode
        first = self._paged[names[0]]
        if self.options.layerwise is None:
            # on CPU a background loader competes with compute for the same cores (copies,
            # reader threads, checksums): one get for the whole step measured faster
            self._loader.layerwise = first.tensor.device.type != "cpu"
        logger.info(
            "TierKVConnector: %d layers x %d stored KV-head shard(s), KV %s %s on %s, block dim %d (x%d), %d B per "
            "block and slice, %s, %s loads", len(info.layers), n, tuple(first.tensor.shape), first.tensor.dtype,
            first.tensor.device, first.block_dim, first.kernel_blocks_per_block, first.block_nbytes,
            "zero-copy" if first.is_direct() else "staged", "layerwise" if self.layerwise else "whole-step",
        )

    def bind_metadata(self, meta: Any) -> None:
        self._metadata = meta if isinstance(meta, TierKVConnectorMetadata) else None
        # the step's forward runs from here to wait_for_save: its time per token is the decline rule's compute
        # (a step that loads in it is not timed: its load is no compute)
        m = self._metadata
        self._step_began = (time.perf_counter(), m.step_tokens if m is not None and not m.loads else 0)
        if self._metadata is not None and (self._metadata.lease_releases or self._metadata.preempted):
            # lookups the scheduler will not load (no blocks for the hit, finished or aborted first), and
            # preempted requests: what they held goes back now
            self.leases.release(self._metadata.lease_releases, LeaseEnd.NOT_LOADED)
            self.leases.release(self._metadata.preempted, LeaseEnd.PREEMPTED)
        if self._metadata is not None and self._metadata.saves:
            # the scheduler holds the blocks of every request it planned a save for until
            # each worker reports it (get_finished), whether or not this worker saves any
            self.saver.note_planned({spec.req_id for spec in self._metadata.saves})
        if self._metadata is not None and self._metadata.async_loads:
            # started now, not in start_load_kv (which vLLM calls after the forward on steps
            # without synchronous loads): the load overlaps this step's forward, so it is
            # usually done by this step's get_finished and the request runs in the next step
            self._start_async_loads(self._metadata.async_loads)

    def clear_metadata(self) -> None:
        self._metadata = None
        self.saver.clear_plans()

    def start_load_kv(self) -> None:
        meta = self._metadata
        self.load_job = None
        if self.closed or meta is None or not meta.loads or not self._paged:
            return
        specs = [spec for spec in meta.loads if spec.block_ids]
        if len(specs) < len(meta.loads):  # (nothing to fill: nothing to hold either)
            self.leases.release((spec.req_id for spec in meta.loads if not spec.block_ids), LeaseEnd.LOADED)
        if specs:
            # each request's plan, as its probe leased it (held until the job settles: _settle)
            self.load_job = self._loader.start(specs, self.leases.plans(s.req_id for s in specs))

    def _start_async_job(self, specs: list[LoadSpec]) -> LoadJob:
        """Run a load between steps, from the plans its requests' probes leased (on the loading thread)."""
        job = self._async_loader.start(specs, self.leases.plans(s.req_id for s in specs))
        if job.future is not None:
            job.future.result()  # (a load that broke fails every block of it: AsyncLoads reports them)
        return job

    def _start_async_loads(self, specs: list[LoadSpec]) -> None:
        # saves of an earlier life of the request (before a preemption) are done (see
        # handle_preemptions) and the scheduler no longer waits for them: it holds the
        # blocks for this load only, until get_finished reports it
        self.saver.forget_planned({s.req_id for s in specs})
        if self.closed or not self._paged:
            # nothing written: vLLM recomputes every block; reported (and its leases ended) by get_finished
            self._async.fail(specs)
        else:
            self._async.submit(specs)

    def _count_async_load(self, job: LoadJob) -> None:
        # the failed blocks go to vLLM with the request (get_finished), not at the step's end
        self._settle(job, LoadMode.ASYNC)

    def _settle(self, job: LoadJob, mode: LoadMode) -> None:
        try:
            if job.future is not None:
                job.future.result()
        finally:
            # the load is over (every block read or failed): what its lookup held goes back
            self.leases.release(job.req_ids, LeaseEnd.LOADED)
        self.counters.add_load(job, mode)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self.load_job
        slices = self._slices_of.get(layer_name)
        if job is None or slices is None:
            return
        for i in slices:
            job.events[i].wait()
            job.wait_return[i] = time.perf_counter()

    def save_kv_layer(self, layer_name: str) -> None:
        meta = self._metadata
        if self.closed or meta is None or not meta.saves:
            return
        slices = self._slices_of.get(layer_name)
        if slices is None or not self._paged:
            return
        # this step loads: a failed load may taint these blocks, so the saves wait for the verdict
        hold = self.load_job is not None
        names = self._slice_names
        for s in slices:
            self.saver.save_layer(meta, s, self._paged[names[s]], hold=hold)

    def _finish_load_job(self) -> None:
        job, self.load_job = self.load_job, None
        if job is not None:
            self._settle(job, LoadMode.SYNC)
        # submit the step's saves, dropping everything computed on a failed block
        self.saver.release_held(job.failed_blocks if job is not None else set())

    def wait_for_save(self) -> None:
        began, tokens = self._step_began
        if tokens > 0:
            self._step_began = (0.0, 0)
            self.counters.add_step(tokens, time.perf_counter() - began)
        for name in self._state_layers:
            self.save_kv_layer(name)
        # the step's loads are over once the forward is; settle them, then release saves
        if self.load_job is not None or self.saver.holding:
            self._finish_load_job()
        if self.options.save_wait:
            self.wait_for_all_saves()

    def handle_preemptions(self, preempted: set[str]) -> None:
        # a preempted request's blocks are freed now: let pending saves finish reading them
        if preempted:
            self.saver.wait_for(preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)``: saves done for finished requests, async loads done."""
        if finished_req_ids:
            self._async.cancel(finished_req_ids)
            # finished or aborted: nothing of theirs is loaded now
            self.leases.release(finished_req_ids, LeaseEnd.FINISHED)
        recving, failed = self._async.take_finished()
        if recving:
            # loads between steps over: read, failed, skipped, or never started (every one is reported once)
            self.leases.release(recving, LeaseEnd.LOADED)
        self.counters.add_leases(*self.leases.take_counts())
        failed_reqs = self._async.take_failed_requests()
        if failed:
            # get_block_ids_with_load_errors, called right after, reports them in this same step (one KV
            # cache group); with several, block ids are not unique and the requests go back instead
            self.counters.add_load_errors(failed)
        if self.info.num_groups > 1:
            self.failed_recving |= failed_reqs
        done = self.saver.finished(finished_req_ids)
        # a finished request is logged once its saves (if any) are in the store
        self._to_log |= finished_req_ids
        loggable = self._to_log - self.saver.waiting()
        self._to_log -= loggable
        for rid in loggable:
            line = self.counters.summary(rid)
            if line:
                logger.info("%s", line)
        self._publish_totals()
        return done or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = self.counters.take_load_errors()
        # several KV cache groups: vLLM cannot map block ids back to requests (it would stop the engine);
        # their failed loads went back as requests (take_failed_recving)
        return failed if self.info.num_groups == 1 else set()

    def take_failed_recving(self) -> set[str]:
        """Requests whose load between steps failed, for vLLM's ``failed_recving`` (several KV cache groups)."""
        out, self.failed_recving = self.failed_recving, set()
        return out

    def take_kv_events(self) -> TierKVEvents | None:
        """The chunk records since the last step, for ``KVConnectorOutput.kv_cache_events``."""
        return self.events.take() if self.events is not None else None

    def get_stats(self) -> TierKVConnectorStats | None:
        if self.events is not None:  # (counted here too where nothing collects the events: a full queue drops)
            self.counters.add_events(*self.events.take_counts())
        due = self._snapshots.due()
        out = self.counters.take_interval(due)
        if out is None or (out.is_empty() and not due):  # (a step's timing alone carries no snapshot)
            return out
        try:  # the store's cumulative numbers ride along (at least once a second), for vLLM's /metrics
            attach_store_snapshot(out.data, self.store, self.tp_rank)
            self._snapshots.sent()
        except Exception as e:  # noqa: BLE001 - metrics never fail a step
            logger.debug("TierKVConnector: no store snapshot: %s", e)
        return out

    # ---- lifecycle ----------------------------------------------------------------
    def pending_saves(self) -> int:
        return self.saver.pending()

    def wait_for_all_saves(self, timeout: float | None = None) -> bool:
        """Block until every queued save is in the store; False on timeout."""
        return self.saver.wait_all(timeout)

    def _report(self, kind: str, payload: dict | None = None) -> None:
        cb = self.report
        if cb is not None:
            try:
                cb(kind, payload)
            except Exception:  # noqa: BLE001 - bookkeeping only
                pass

    def _publish_totals(self) -> None:
        reduced = self.counters.totals_if_changed()
        if reduced is not None:
            self._report("totals", reduced)

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain queued saves (up to ``timeout``, default ``shutdown_timeout_s``), log the totals,
        then release the store and close the channels.  Idempotent, thread-safe."""
        if not self._closing.acquire(blocking=False):
            return  # another thread is shutting down
        try:
            if self.closed:
                return
            self.closed = True
            timeout = self.options.shutdown_timeout_s if timeout is None else timeout
            try:
                if self.load_job is not None or self.saver.holding:
                    self._finish_load_job()
                # loads between steps: skip the queued ones, let the one under way end (it writes
                # into blocks vLLM still holds for it), before the store goes
                if not self._async.close(timeout):
                    logger.warning("TierKVConnector: a background load still runs after %.1f s", timeout)
                self.saver.close(timeout)
                self._loader.close()
                self.leases.release_all(LeaseEnd.SHUTDOWN)
                self.counters.add_leases(*self.leases.take_counts())
                logger.info("TierKVConnector totals: %s", self.counters.reduced_totals())
                self._report("logged")
            finally:
                servers, self._servers = self._servers, []
                for server in servers:
                    server.close()
                owned, self._owned, self.store = self._owned, None, None
                if self.events is not None and owned is not None:
                    owned.remove_removal_listener(self.events.on_removed)
                try:
                    if owned is not None:
                        self._release(owned)
                finally:
                    self._report("clean")
                    self.report = None
        finally:
            self._closing.release()


def _flush_and_close(store: TieredStore) -> None:
    try:
        store.flush()
    finally:
        store.close()
