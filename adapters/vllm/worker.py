"""The connector's worker side: the KV cache, the store, loads, saves and the lookups it answers.

Objects
    A request's KV is stored in chunks of ``chunk_tokens`` (whole blocks; see
    chunks.py): one object per (chunk, layer, KV-head shard), named from vLLM's
    hash of the chunk's last block.  Full chunks are saved as they complete; the
    blocks after the last full chunk are saved as a shorter *tail* once the
    prompt is prefilled.

Loads (loading.py, async_loading.py)
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
    the store, so the connector queues nothing between steps (the store's
    write-behind copies to a persistent tier may still be queued: docs/vllm.md,
    "When the engine goes down").  ``get_finished`` reports requests whose saves are done.

Ownership
    The worker owns its store reference (released at ``shutdown``), its lookup
    server and its save thread; vLLM owns the KV cache.  ``shutdown`` is
    idempotent and may come from vLLM, a signal, the lookup channel or the exit
    of the interpreter: it drains (up to ``shutdown_timeout_s``), logs the
    totals, flushes and closes the store and removes the lookup socket.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tierkv.keys import block_hash_root, keys_from_root

from .async_loading import AsyncLoads
from .chunks import Chunk, covered, resolve
from .config import ConnectorOptions, EngineInfo, block_hash_bytes, layer_namespace
from .loading import Loader, LoadJob
from .lookup import LookupServer, endpoint, sweep_stale_sockets
from .metadata import LoadSpec, TierKVConnectorMetadata
from .paged import Cuts, PagedLayer
from .prom import SnapshotClock, attach_store_snapshot, watch_store
from .saving import SaveItem, SavePlan
from .stats import RequestRecords, SaveTally, TierKVConnectorStats

logger = logging.getLogger("vllm.tierkv.worker")

#: namespace roots kept per worker (layers x KV-head shards x cache salts seen); beyond it they are recomputed
_ROOTS_MAX = 1 << 14


class TierKVWorker:
    """Worker-side logic of ``TierKVConnector`` (one per tensor-parallel rank).

    ``store`` is a ``TieredStore`` (or anything with its API); ``release(store)``
    is called once at shutdown (default: ``store.flush()`` then ``store.close()``).
    ``serve``: answer the scheduler's lookups on this rank's socket.
    """

    def __init__(self, options: ConnectorOptions, info: EngineInfo, store: Any, *,
                 release: Callable[[Any], None] | None = None, serve: bool = True) -> None:
        self.options = options
        self.info = info
        self.store = store
        watch_store(store)  # latency histograms for vLLM's /metrics
        self._snapshots = SnapshotClock()
        self._release = release or _flush_and_close
        self._bs = info.block_size
        self._G = max(1, options.chunk_tokens // info.block_size)
        self._layers = list(info.layers)
        self._layer_index = info.layer_index
        self.shard = info.shard
        self.tp_rank = info.tp_rank
        tiers = store.tier_info()
        self._locality = {t["name"]: t["locality"] for t in tiers}
        # replicas of a shard split the writes only when every tier is shared between
        # processes; with private tiers each replica must hold what it will load
        self._split_writes = self.shard.replicas > 1 and all(t["shared"] for t in tiers)
        self._paged: dict[str, PagedLayer] = {}
        self._loader = Loader(layers=self._layers, paged=self._paged, block_size=self._bs, store=lambda: self.store,
                              resolve=self._resolve_last_layer, layer_keys=self._hash_keys,
                              tp_rank=info.tp_rank, tp_size=info.tp_size)
        self._loader.layerwise = options.layerwise is True  # "auto" is settled in register_kv_caches
        # loads between steps (load_async): a loader of their own (its discard buffers are
        # not shared with the engine thread's loads), every layer in one get
        self._async_loader = Loader(layers=self._layers, paged=self._paged, block_size=self._bs,
                                    store=lambda: self.store, resolve=self._resolve_last_layer,
                                    layer_keys=self._hash_keys, tp_rank=info.tp_rank, tp_size=info.tp_size)
        self._async = AsyncLoads(self._async_loader.start, on_done=self._account_async_load)
        self._metadata: TierKVConnectorMetadata | None = None
        self.load_job: LoadJob | None = None
        self._deferred: list[SaveItem] = []
        self._roots: dict[tuple[int, int, str | None], bytes] = {}
        self._save_plans: tuple[TierKVConnectorMetadata, list[SavePlan | None]] | None = None
        self._save_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-save")
        self._lock = threading.Condition()
        self._pending: collections.Counter = collections.Counter()
        self._seen_save_reqs: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._to_log: set[str] = set()
        self._load_errors: set[int] = set()
        self._interval = TierKVConnectorStats()
        self.totals = TierKVConnectorStats()
        self.request_records = RequestRecords()
        #: load jobs run: in the engine's step ("sync") and between steps ("async")
        self.load_counts = {"sync": 0, "async": 0}
        #: the last load jobs' per-layer timestamps (submit, begin, end, wait_return)
        self.load_trace: collections.deque = collections.deque(maxlen=64)
        self._closing = threading.Lock()
        self.closed = False
        #: told ("totals", reduced totals) when they change, ("logged", None) once the totals line is
        #: out and ("clean", None) when the shutdown is complete (see lifecycle.Watcher)
        self.report: Callable[[str, dict | None], None] | None = None
        self._totals_sent: dict | None = None
        self._server: LookupServer | None = None
        if serve:
            sweep_stale_sockets()  # file sockets of killed predecessors
            path, key = endpoint(info.engine_id, info.dp_rank, info.tp_rank)
            self._server = LookupServer(path, key, self.answer)

    @property
    def layerwise(self) -> bool:
        return self._loader.layerwise

    @property
    def lookup_path(self) -> str | None:
        return self._server.path if self._server is not None else None

    # ---- keys and lookups ---------------------------------------------------------
    def layer_keys(self, layer: int, hashes: list, cache_salt: str | None, shard: int | None = None) -> list[str]:
        """Store keys of the chunks named by ``hashes`` for one layer (of this rank's shard by default)."""
        return self._hash_keys(layer, [block_hash_bytes(h) for h in hashes], cache_salt, shard)

    def _hash_keys(self, layer: int, hashes: list[bytes], cache_salt: str | None,
                   shard: int | None = None) -> list[str]:
        """:meth:`layer_keys` of hashes already in bytes: one SHA-256 per key, the layer's root kept."""
        sh = self.shard.shard if shard is None else shard
        root = self._roots.get((sh, layer, cache_salt))
        if root is None:
            root = block_hash_root(layer_namespace(self.info.namespaces[sh], self._layers[layer], cache_salt))
            if len(self._roots) >= _ROOTS_MAX:
                self._roots.clear()
            self._roots[(sh, layer, cache_salt)] = root
        return keys_from_root(root, hashes)

    def resolve(self, hashes: list, base: int, lo: int, hi: int, salt: str | None,
                all_layers: bool = True, where: dict[str, str | None] | None = None) -> list[Chunk]:
        """Stored chunks covering the leading blocks of ``lo..hi-1`` (``hashes[i]`` = block ``base+i``).

        ``all_layers``: every layer must hold a chunk (else only the last layer is
        asked, the one written last).  ``where``: filled with the tier holding each
        last-layer key asked about (None: none), from the same store calls.  Two
        store calls at most per question, whatever the layer count: a shared tier
        answers each with one round trip to its service.
        """
        store = self.store
        if store is None or self.closed:
            raise RuntimeError("the connector's worker is shut down")
        L = len(self._layers)
        layers = list(reversed(range(L))) if all_layers else [L - 1]

        def keys(layer: int, ends: list[int]) -> list[str]:
            return self._hash_keys(layer, [block_hash_bytes(hashes[e - base]) for e in ends], salt)

        def all_keys(ends: list[int]) -> list[str]:
            # the layers after the first, one conversion of the hashes for all of them
            hb = [block_hash_bytes(hashes[e - base]) for e in ends]
            return [k for layer in layers[1:] for k in self._hash_keys(layer, hb, salt)]

        def first_layer(ends: list[int]) -> list[bool]:
            ks = keys(layers[0], ends)
            if where is None:
                return store.contains(ks)
            tiers = store.locate(ks)
            where.update(zip(ks, tiers))
            return [t is not None for t in tiers]

        def full_present(ends: list[int]) -> int:
            # the last layer is written last: asked alone first, it fails fastest
            if not ends:
                return 0
            if where is None:
                n = int(store.lookup(keys(layers[0], ends)))
            else:
                there = first_layer(ends)
                n = there.index(False) if False in there else len(ends)
            if n == 0 or len(layers) == 1:
                return n
            w = n
            present = store.contains(all_keys(ends[:w]))
            for row in range(len(layers) - 1):
                lead = present[row * w:(row + 1) * w]
                if False in lead:
                    n = min(n, lead.index(False))
            return n

        def tail_present(ends: list[int]) -> int | None:
            cands = [j for j, there in zip(ends, first_layer(ends)) if there]
            if not cands or len(layers) == 1:
                return cands[0] if cands else None
            m = len(cands)
            present = store.contains(all_keys(cands))
            for i, j in enumerate(cands):
                if all(present[row * m + i] for row in range(len(layers) - 1)):
                    return j
            return None

        return resolve(lo, hi, base + len(hashes), self._G, full_present, tail_present)

    def _resolve_last_layer(self, hashes, base, lo, hi, salt, where) -> list[Chunk]:
        return self.resolve(hashes, base, lo, hi, salt, all_layers=False, where=where)

    def answer(self, op: str, *args: Any) -> Any:
        """The scheduler's questions, on this worker's store and KV shard (see lookup.py)."""
        if op == "shutdown":
            self.shutdown()
            return None
        hashes, base, lo, hi, salt = args
        if op == "probe":  # (hashes from block 0): reach from lo, held below lo, tiers of the reached blocks
            if base != 0:
                raise ValueError("probe: the hashes must start at block 0")
            reach = covered(self.resolve(hashes, 0, lo, hi, salt), lo, hi) if hi > lo else 0
            held = covered(self.resolve(hashes, 0, 0, lo, salt), 0, lo) if lo else 0
            return reach, held, self._locate(hashes, 0, lo, lo + reach, salt) if reach else []
        if op == "lookup":
            return covered(self.resolve(hashes, base, lo, hi, salt), lo, hi)
        if op == "locate":
            return self._locate(hashes, base, lo, hi, salt)
        raise ValueError(f"unknown lookup op {op!r}")

    def _locate(self, hashes: list[bytes], base: int, lo: int, hi: int, salt: str | None) -> list[Any]:
        """(tier name, locality) of each block ``lo..hi-1``, or None where no tier holds it."""
        found: dict[str, str | None] = {}
        chunks = self.resolve(hashes, base, lo, hi, salt, all_layers=False, where=found)
        where = [found.get(k) for k in self.layer_keys(len(self._layers) - 1,
                                                       [hashes[c[1] - base] for c in chunks], salt)]
        out: list[Any] = [None] * (hi - lo)
        for (first, last), t in zip(chunks, where):
            for b in range(max(first, lo), min(last + 1, hi)):
                out[b - lo] = None if t is None else (t, self._locality.get(t))
        return out

    # ---- vLLM's worker hooks --------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name in self._layers:
            t = kv_caches.get(name)
            if t is None:
                raise ValueError(f"TierKVConnector: no KV cache tensor for layer {name!r}")
            self._paged[name] = PagedLayer.wrap(t, self.info.num_blocks, self._bs)
        for paged in self._paged.values():
            paged.prepare()  # views of the cache made here, outside the engine's inference mode
        first = self._paged[self._layers[0]]
        if self.options.layerwise is None:
            # on CPU a background loader competes with compute for the same cores (copies,
            # reader threads, checksums): one get for the whole step measured faster
            self._loader.layerwise = first.tensor.device.type != "cpu"
        logger.info(
            "TierKVConnector: %d layers, KV %s %s on %s, block dim %d (x%d), %d B per block and layer, %s, %s loads",
            len(self._layers), tuple(first.tensor.shape), first.tensor.dtype, first.tensor.device, first.block_dim,
            first.kernel_blocks_per_block, first.block_nbytes, "zero-copy" if first.is_direct() else "staged",
            "layerwise" if self.layerwise else "whole-step",
        )

    def bind_metadata(self, meta: Any) -> None:
        self._metadata = meta if isinstance(meta, TierKVConnectorMetadata) else None
        if self._metadata is not None and self._metadata.saves:
            # the scheduler holds the blocks of every request it planned a save for until
            # each worker reports it (get_finished), whether or not this worker saves any
            with self._lock:
                self._seen_save_reqs.update(spec.req_id for spec in self._metadata.saves)
        if self._metadata is not None and self._metadata.async_loads:
            # started now, not in start_load_kv (which vLLM calls after the forward on steps
            # without synchronous loads): the load overlaps this step's forward, so it is
            # usually done by this step's get_finished and the request runs in the next step
            self._start_async_loads(self._metadata.async_loads)

    def clear_metadata(self) -> None:
        self._metadata = None
        self._save_plans = None

    def start_load_kv(self) -> None:
        meta = self._metadata
        self.load_job = None
        if self.closed or meta is None or not meta.loads or not self._paged:
            return
        specs = [spec for spec in meta.loads if spec.block_ids]
        if specs:
            self.load_job = self._loader.start(specs)

    def _start_async_loads(self, specs: list[LoadSpec]) -> None:
        with self._lock:
            # saves of an earlier life of the request (before a preemption) are done (see
            # handle_preemptions) and the scheduler no longer waits for them: it holds the
            # blocks for this load only, until get_finished reports it
            self._seen_save_reqs.difference_update(s.req_id for s in specs)
        if self.closed or not self._paged:
            self._async.fail(specs)  # nothing written: vLLM recomputes every block
        else:
            self._async.submit(specs)

    def _account_async_load(self, job: LoadJob) -> None:
        # the failed blocks go to vLLM with the request (get_finished), not at the step's end
        self._account_load(job, report_errors=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self.load_job
        i = self._layer_index.get(layer_name)
        if job is None or i is None:
            return
        job.events[i].wait()
        job.wait_return[i] = time.perf_counter()

    def save_kv_layer(self, layer_name: str) -> None:
        meta = self._metadata
        if self.closed or meta is None or not meta.saves:
            return
        layer = self._layer_index.get(layer_name)
        paged = self._paged.get(layer_name)
        if layer is None or paged is None:
            return
        # views of a CPU cache are cut, with the keys, on the save thread: nothing of the
        # per-chunk work stays on the engine's thread.  A staged layout (device memory, strided
        # views) is copied out here, in the engine's stream order, before the layer is reused.
        direct = paged.is_flat()
        for plan in self._plans(meta):
            if plan is None:
                continue
            item = SaveItem(plan, layer, None if direct else paged.read_cut(plan.cuts))
            with self._lock:
                self._pending[plan.spec.req_id] += 1
            if self.load_job is not None:
                # this step loads: a failed load may taint these blocks, so wait for the verdict
                self._deferred.append(item)
            else:
                self._submit_save(item)

    def _plans(self, meta: TierKVConnectorMetadata) -> list[SavePlan | None]:
        """The step's save specs as this rank saves them (None: nothing of it here), made at its first layer."""
        if self._save_plans is not None and self._save_plans[0] is meta:
            return self._save_plans[1]
        shard = self.shard
        plans: list[SavePlan | None] = []
        for spec in meta.saves:
            if self._split_writes:
                pos = [j for j, (first, _) in enumerate(spec.chunks)
                       if (first // self._G) % shard.replicas == shard.replica]
            else:
                pos = list(range(len(spec.chunks)))
            plans.append(SavePlan(spec, pos) if pos else None)
        self._save_plans = (meta, plans)
        return plans

    def _submit_save(self, item: SaveItem) -> None:
        try:
            self._save_pool.submit(self._run_save, item)
        except RuntimeError:  # shut down meanwhile: the save is abandoned
            self._save_done(item.req_id)

    def _save_done(self, rid: str) -> None:
        with self._lock:
            self._pending[rid] -= 1
            if self._pending[rid] <= 0:
                del self._pending[rid]
            self._lock.notify_all()

    def _run_save(self, item: SaveItem) -> None:
        plan, layer, keep = item.plan, item.layer, item.keep
        spec = plan.spec
        chunks = item.chunks()
        t0 = time.perf_counter()
        tally = SaveTally()
        try:
            try:
                keys = self._hash_keys(layer, plan.hashes if keep is None else [plan.hashes[j] for j in keep],
                                       spec.cache_salt)
                values = item.values
                if values is None:
                    cuts = plan.cuts if keep is None else Cuts([plan.cuts.objects[j] for j in keep])
                    values = self._paged[self._layers[layer]].read_cut(cuts)
                put = getattr(self.store, "put_detailed", None) or self.store.put
                ok: list[Any] = put(keys, values)
            except Exception as e:  # noqa: BLE001 - a broken backend loses a save, nothing else
                logger.warning("TierKVConnector: put failed for %s layer %d: %s", spec.req_id, layer, e)
                ok = [False] * len(chunks)
            tally = SaveTally.of(ok, chunks, self._paged[self._layers[layer]].block_nbytes)
        finally:
            tally.seconds = time.perf_counter() - t0
            with self._lock:
                tally.add_to(self._interval)
                tally.add_to(self.totals)
                self.request_records.add_save(spec.req_id, tally)
            self._save_done(spec.req_id)

    def _finish_load_job(self) -> None:
        job, self.load_job = self.load_job, None
        if job is not None:
            self._account_load(job)
        failed = job.failed_blocks if job is not None else set()
        # submit the step's saves, dropping everything computed on a failed block
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            spec = item.plan.spec
            cut = next((p for p, bid in enumerate(spec.table) if bid in failed), None) if failed else None
            if cut is not None:
                keep = [j for j, (_, last) in enumerate(item.plan.chunks) if last < cut]
                if not keep:
                    self._save_done(spec.req_id)
                    continue
                values = None if item.values is None else [item.values[j] for j in keep]
                item = SaveItem(item.plan, item.layer, values, keep)
            self._submit_save(item)

    def _account_load(self, job: LoadJob, report_errors: bool = True) -> None:
        if job.future is not None:
            job.future.result()
        elapsed = max(job.end) - job.submit_t if job.end else 0.0
        failed = set(job.failed_blocks)
        with self._lock:
            self.load_counts["sync" if report_errors else "async"] += 1
            if report_errors:
                self._load_errors |= failed
            for s in (self._interval, self.totals):
                d = s.data
                d["load_requests"] += len(job.per_req)
                d["load_blocks"] += job.nblocks
                d["load_tokens"] += job.ntokens
                d["load_bytes"] += job.nbytes
                d["load_s"] += elapsed
                d["load_errors"] += len(failed)
                hits = d.setdefault("hit_tokens", {})
                for tier, n in job.hit_tokens.items():
                    hits[tier] = hits.get(tier, 0) + n
            for rid, pr in job.per_req.items():
                rec = self.request_records.record(rid)
                rec["load_tokens"] += pr["tokens"]
                rec["load_bytes"] += pr["bytes"]
                rec["load_s"] += elapsed
                for tier, n in pr["hit_tokens"].items():
                    rec["hit_tokens"][tier] = rec["hit_tokens"].get(tier, 0) + n
                if rid in job.failed_reqs:
                    rec["load_errors"] += 1
        self.load_trace.append(job.trace())
        if failed:
            logger.warning("TierKVConnector: %d block(s) failed to load; vLLM recomputes them", len(failed))

    def wait_for_save(self) -> None:
        # the step's loads are over once the forward is; settle them, then release saves
        if self.load_job is not None or self._deferred:
            self._finish_load_job()
        if self.options.save_wait:
            self.wait_for_all_saves()

    def handle_preemptions(self, preempted: set[str]) -> None:
        # a preempted request's blocks are freed now: let pending saves finish reading them
        if preempted:
            with self._lock:
                self._lock.wait_for(lambda: not any(self._pending.get(r) for r in preempted))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)``: saves done for finished requests, async loads done."""
        if finished_req_ids:
            self._async.cancel(finished_req_ids)
        recving, failed = self._async.take_finished()
        if failed:
            with self._lock:
                # get_block_ids_with_load_errors, called right after, reports them in this same step
                self._load_errors |= failed
        return self._finished_saves(finished_req_ids), recving or None

    def _finished_saves(self, finished_req_ids: set[str]) -> set[str] | None:
        with self._lock:
            self._finished_waiting |= finished_req_ids & self._seen_save_reqs
            done = {r for r in self._finished_waiting if not self._pending.get(r)}
            self._finished_waiting -= done
            self._seen_save_reqs -= done
            # a finished request is logged once its saves (if any) are in the store
            self._to_log |= finished_req_ids
            loggable = {r for r in self._to_log if r not in self._finished_waiting}
            self._to_log -= loggable
        for rid in loggable:
            rec = self.request_records.get(rid)
            line = RequestRecords.summary(rid, rec) if rec is not None else None
            if line:
                logger.info("%s", line)
        self._publish_totals()
        return done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def get_stats(self) -> TierKVConnectorStats | None:
        with self._lock:
            if self._interval.is_empty() and not self._snapshots.due():
                return None
            out, self._interval = self._interval, TierKVConnectorStats()
        try:  # the store's cumulative numbers ride along (at least once a second), for vLLM's /metrics
            attach_store_snapshot(out.data, self.store, self.tp_rank)
            self._snapshots.sent()
        except Exception as e:  # noqa: BLE001 - metrics never fail a step
            logger.debug("TierKVConnector: no store snapshot: %s", e)
        return out

    # ---- lifecycle ----------------------------------------------------------------
    def pending_saves(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    def wait_for_all_saves(self, timeout: float | None = None) -> bool:
        """Block until every queued save is in the store; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout=timeout)

    def _report(self, kind: str, payload: dict | None = None) -> None:
        cb = self.report
        if cb is not None:
            try:
                cb(kind, payload)
            except Exception:  # noqa: BLE001 - bookkeeping only
                pass

    def _publish_totals(self) -> None:
        with self._lock:
            reduced = self.totals.reduce()
        if reduced != self._totals_sent:
            self._totals_sent = reduced
            self._report("totals", reduced)

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain queued saves (up to ``timeout``, default ``shutdown_timeout_s``), log the totals,
        then flush and close the store and remove the lookup socket.  Idempotent, thread-safe."""
        if not self._closing.acquire(blocking=False):
            return  # another thread is shutting down
        try:
            if self.closed:
                return
            self.closed = True
            timeout = self.options.shutdown_timeout_s if timeout is None else timeout
            try:
                if self.load_job is not None or self._deferred:
                    self._finish_load_job()
                # loads between steps: skip the queued ones, let the one under way end (it writes
                # into blocks vLLM still holds for it), before the store goes
                if not self._async.close(timeout):
                    logger.warning("TierKVConnector: a background load still runs after %.1f s", timeout)
                if not self.wait_for_all_saves(timeout):
                    logger.warning("TierKVConnector: %d save(s) still queued after %.1f s: abandoned",
                                   self.pending_saves(), timeout)
                    self._save_pool.shutdown(wait=False, cancel_futures=True)
                self._save_pool.shutdown(wait=True)
                self._loader.close()
                with self._lock:
                    reduced = self.totals.reduce()
                logger.info("TierKVConnector totals: %s", reduced)
                self._report("logged")
            finally:
                if self._server is not None:
                    self._server.close()
                    self._server = None
                store, self.store = self.store, None
                try:
                    if store is not None:
                        self._release(store)
                finally:
                    self._report("clean")
                    self.report = None
        finally:
            self._closing.release()


def _flush_and_close(store: Any) -> None:
    try:
        store.flush()
    finally:
        store.close()
