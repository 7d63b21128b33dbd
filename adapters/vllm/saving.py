"""The worker's save path: each step's save plans, the save thread, and which requests' saves are done.

A ``SavePlan`` is made once per request and step (the chunks this rank saves, their
block hashes as bytes, and where their blocks lie in the paged cache); every layer
of the step reuses it, so the per-layer work is one ``SaveItem``: the plan, the
layer, and the chunks' bytes when the engine thread had to stage them.

:class:`Saver` runs the puts on one background thread (``tierkv-save``), one
``put_detailed`` per item, and counts each answer (``SaveTally``).  While a step
also loads, its saves are *held* until the load's verdict: a failed load taints
the blocks computed from it, so the saves from the first failed block on are
dropped (:meth:`Saver.release_held`).  A request is reported finished once no save
of it is pending; a preempted request's pending saves are waited for before vLLM
frees its blocks.

A save whose spec carries an audit (``SaveSpec.audit``: the scheduler served a hit
as a miss, at ``audit_rate``) hands the chunks it covers to the :class:`Auditor`
after the put: those the put found already stored are compared with the bytes
just computed, and a stored copy that differs is removed (audit.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierkv.outcome import PutOutcome

from .accounting import WorkerCounters
from .audit import Auditor, AuditTally
from .chunks import Chunk
from .config import ShardInfo, block_hash_bytes, salt_tenant
from .connector_stats import SaveTally
from .kv_events import ChunkEvents
from .layer_keys import LayerKeys
from .metadata import SaveSpec, TierKVConnectorMetadata
from .paged import Cuts, PagedLayer

logger = logging.getLogger("vllm.tierkv.saving")


class SavePlan:
    """One save spec's chunks on this rank, as every layer of the step uses them."""

    __slots__ = ("audited", "chunks", "cuts", "hashes", "layers_left", "spec", "state_keep", "unsaved", "written")

    def __init__(self, spec: SaveSpec, pos: list[int], num_groups: int = 1) -> None:
        self.spec = spec
        self.chunks = [spec.chunks[j] for j in pos]
        #: positions in ``chunks`` of those whose recurrent state this step offers (the only ones a state
        #: group saves)
        offered = set(spec.state_chunks or ())
        self.state_keep = [i for i, j in enumerate(pos) if j in offered]
        self.hashes = [block_hash_bytes(spec.block_hashes[j]) for j in pos]
        #: where the chunks' blocks lie, per KV cache group (each group has its own block ids)
        self.cuts = [Cuts([ids[j] for j in pos]) for ids in (spec.ids_of(g) for g in range(num_groups))]
        #: positions in ``chunks`` of those an audit compares with the stored copies
        self.audited = spec.audited(self.chunks)
        #: for KV events, per chunk: layers whose put is still to come, whether one was not saved, whether one
        #: was written now (set by :meth:`track`; empty: not tracked)
        self.layers_left: list[int] = []
        self.unsaved: list[bool] = []
        self.written: list[bool] = []

    def track(self, plain_layers: int, state_layers: int) -> None:
        """Count each chunk's puts: every layer outside a state group, and a state group's only where this step
        offers the chunk's state."""
        offered = set(self.state_keep)
        n = len(self.chunks)
        self.layers_left = [plain_layers + (state_layers if i in offered else 0) for i in range(n)]
        self.unsaved = [False] * n
        self.written = [False] * n


class SaveItem:
    """One put: a plan's chunks (``keep``: only these of them; None: all) of one layer.

    ``values`` are the chunks' bytes when the engine thread had to stage them (a
    device or strided cache); None when the save thread cuts them itself, as views
    of a CPU cache, keys and all, off the engine's thread.
    """

    __slots__ = ("keep", "layer", "plan", "values")

    def __init__(self, plan: SavePlan, layer: int, values: list | None, keep: list[int] | None = None) -> None:
        self.plan, self.layer, self.values, self.keep = plan, layer, values, keep

    @property
    def req_id(self) -> str:
        return self.plan.spec.req_id

    def chunks(self) -> list[Chunk]:
        chunks = self.plan.chunks
        return chunks if self.keep is None else [chunks[j] for j in self.keep]

    def audited(self) -> list[int]:
        """Positions in :meth:`chunks` of those the audit covers."""
        audited = self.plan.audited
        if self.keep is None or not audited:
            return audited
        covered = set(audited)
        return [i for i, j in enumerate(self.keep) if j in covered]


class Saver:
    """Puts a worker's step saves on its save thread and tracks them per request.

    ``store()`` is the store to put into (looked up per put, so a caller may wrap
    it); ``paged`` the worker's layers (filled by ``register_kv_caches``).
    ``split_writes``: replicas of this KV-head shard share the tiers, so each saves
    its share of the chunks only.  ``auditor`` compares the audited saves with the
    stored copies (None: audits are not checked, and count as skipped).
    """

    def __init__(self, *, keys: LayerKeys, layers: list[str], paged: dict[str, PagedLayer], chunk_blocks: int,
                 shard: ShardInfo, split_writes: bool, store: Callable[[], Any], counters: WorkerCounters,
                 group_of: Callable[[int], int] = lambda layer: 0, num_groups: int = 1,
                 auditor: Auditor | None = None, state_groups: frozenset[int] = frozenset(),
                 tenant: str | None = None, events: ChunkEvents | None = None) -> None:
        self._auditor = auditor
        #: the tenant of a put whose request carries no cache_salt (the connector's ``namespace``)
        self._tenant = tenant
        self._state_groups = state_groups
        #: where chunks that became stored are reported (vLLM KV events); None: not reported
        self._events = events
        state_layers = sum(1 for i in range(len(layers)) if group_of(i) in state_groups)
        self._layer_counts = (len(layers) - state_layers, state_layers)
        self._keys = keys
        self._group_of = group_of
        self._num_groups = num_groups
        self._layers = layers
        self._paged = paged
        self._G = chunk_blocks
        self._shard = shard
        self._split_writes = split_writes
        self._store = store
        self._counters = counters
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-save")
        self._cond = threading.Condition()
        self._pending: collections.Counter = collections.Counter()
        self._held: list[SaveItem] = []
        self._plans: tuple[TierKVConnectorMetadata, list[SavePlan | None]] | None = None
        #: requests a save was planned for that are not reported finished yet
        self._planned: set[str] = set()
        self._finished_waiting: set[str] = set()

    # ---- the engine's thread ------------------------------------------------------
    def note_planned(self, req_ids: set[str]) -> None:
        """The scheduler holds these requests' blocks until each worker reports them (``finished``)."""
        with self._cond:
            self._planned.update(req_ids)

    def forget_planned(self, req_ids: set[str]) -> None:
        """The scheduler no longer waits for these requests' saves (their earlier life, before a preemption)."""
        with self._cond:
            self._planned.difference_update(req_ids)

    def save_layer(self, meta: TierKVConnectorMetadata, layer: int, paged: PagedLayer, hold: bool) -> None:
        """Queue the step's puts of one layer; ``hold``: the step loads, keep them until its verdict."""
        # views of a CPU cache are cut, with the keys, on the save thread: nothing of the
        # per-chunk work stays on the engine's thread.  A staged layout (device memory, strided
        # views) is copied out here, in the engine's stream order, before the layer is reused.
        direct = paged.is_flat()
        group = self._group_of(layer)
        for plan in self._plans_of(meta):
            if plan is None:
                continue
            if group in self._state_groups:
                # a state block holds the state at its boundary only during the step that offers it (vLLM frees
                # or overwrites it in a later one): copied now, on the engine's thread
                if not plan.state_keep:
                    continue
                objects = plan.cuts[group].objects
                values = [[p.clone() for p in paged.read_runs([b for b in objects[j] if b is not None])]
                          for j in plan.state_keep]
                item = SaveItem(plan, layer, values, list(plan.state_keep))
            else:
                item = SaveItem(plan, layer, None if direct else paged.read_cut(plan.cuts[group]))
            with self._cond:
                self._pending[plan.spec.req_id] += 1
            if hold:
                self._held.append(item)
            else:
                self._submit(item)

    def clear_plans(self) -> None:
        self._plans = None

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def release_held(self, failed_blocks: set[int]) -> None:
        """Submit the held saves, dropping from each request's first block in ``failed_blocks`` on."""
        held, self._held = self._held, []
        for item in held:
            spec = item.plan.spec
            cut = next((p for p, bid in enumerate(spec.table) if bid in failed_blocks), None) if failed_blocks else None
            if cut is not None:
                had = item.keep if item.keep is not None else range(len(item.plan.chunks))
                at = [i for i, j in enumerate(had) if item.plan.chunks[j][1] < cut]
                if not at:
                    self._done(spec.req_id)
                    continue
                values = None if item.values is None else [item.values[i] for i in at]
                item = SaveItem(item.plan, item.layer, values, [had[i] for i in at])
            self._submit(item)

    def _plans_of(self, meta: TierKVConnectorMetadata) -> list[SavePlan | None]:
        """The step's save specs as this rank saves them (None: nothing of it here), made at its first layer."""
        if self._plans is not None and self._plans[0] is meta:
            return self._plans[1]
        shard = self._shard
        plans: list[SavePlan | None] = []
        for spec in meta.saves:
            if self._split_writes:
                pos = [j for j, (first, _) in enumerate(spec.chunks)
                       if (first // self._G) % shard.replicas == shard.replica]
            else:
                pos = list(range(len(spec.chunks)))
            plan = SavePlan(spec, pos, self._num_groups) if pos else None
            if plan is not None and self._events is not None:
                plan.track(*self._layer_counts)
            plans.append(plan)
        self._plans = (meta, plans)
        return plans

    # ---- the save thread ----------------------------------------------------------
    def _submit(self, item: SaveItem) -> None:
        try:
            self._pool.submit(self._run, item)
        except RuntimeError:  # shut down meanwhile: the save is abandoned
            self._done(item.req_id)

    def _done(self, rid: str) -> None:
        with self._cond:
            self._pending[rid] -= 1
            if self._pending[rid] <= 0:
                del self._pending[rid]
            self._cond.notify_all()

    def _run(self, item: SaveItem) -> None:
        plan, layer, keep = item.plan, item.layer, item.keep
        spec = plan.spec
        chunks = item.chunks()
        t0 = time.perf_counter()
        tally = SaveTally()
        audit = AuditTally()
        try:
            keys: list[str] | None = None
            values: Any = None
            try:
                keys = self._keys.keys(layer, plan.hashes if keep is None else [plan.hashes[j] for j in keep],
                                       spec.cache_salt)
                values = item.values
                if values is None:
                    cuts = plan.cuts[self._group_of(layer)]
                    cuts = cuts if keep is None else Cuts([cuts.objects[j] for j in keep])
                    values = self._paged[self._layers[layer]].read_cut(cuts)
                # a request's cache_salt names its tenant, else the engine's namespace (``tierkv.tenants``)
                salt = salt_tenant(spec.cache_salt)  # (the key salt less the LoRA adapter's identity)
                tenant = salt if salt is not None else self._tenant
                outcomes: list[PutOutcome] = self._store().put_detailed(keys, values, tenant=tenant)
            except Exception as e:  # noqa: BLE001 - a broken backend loses a save, nothing else
                logger.warning("TierKVConnector: put failed for %s layer %d: %s", spec.req_id, layer, e)
                outcomes = [PutOutcome.ERROR] * len(chunks)
            paged = self._paged[self._layers[layer]]
            tally = SaveTally.of(outcomes, chunks, paged.block_nbytes)
            if self._events is not None and plan.layers_left:
                self._track(plan, keep, keys, outcomes)
            audited = item.audited()
            if audited:
                audit = self._audit(item, keys, values, outcomes, audited, paged)
        finally:
            tally.seconds = time.perf_counter() - t0
            self._counters.add_save(spec.req_id, tally, audit)
            self._done(spec.req_id)

    def _track(self, plan: SavePlan, keep: list[int] | None, keys: list[str] | None,
               outcomes: list[PutOutcome]) -> None:
        """Map the keys written now to their chunks, and report each chunk whose every layer is now saved (one
        of them written now) stored, in the tier its fastest copy lies in (vLLM's KV events, kv_events.py)."""
        events = self._events
        if events is None:
            return
        done: list[int] = []
        for i, j in enumerate(range(len(plan.chunks)) if keep is None else keep):
            outcome = outcomes[i]
            if outcome is PutOutcome.STORED and keys is not None:
                plan.written[j] = True
                events.note_keys(plan.hashes[j], [keys[i]])
            elif not outcome:
                plan.unsaved[j] = True
            plan.layers_left[j] -= 1
            if plan.layers_left[j] == 0 and plan.written[j] and not plan.unsaved[j] and keys is not None:
                done.append(i)
        if done and keys is not None:
            try:
                where = self._store().locate([keys[i] for i in done])
            except Exception as e:  # noqa: BLE001 - a closed or broken store loses the events, counted
                logger.warning("TierKVConnector: %d KV event(s) dropped: locate failed: %s", len(done), e)
                events.drop(len(done))
                return
            for i, tier in zip(done, where):
                if tier is not None:  # (gone already: its removal was heard, nothing to publish)
                    events.stored(plan.hashes[i if keep is None else keep[i]], tier)

    def _audit(self, item: SaveItem, keys: list[str] | None, values: Any, outcomes: list[PutOutcome],
               audited: list[int], paged: PagedLayer) -> AuditTally:
        """Compare the audited chunks of one save with the store's copies (a failure skips them, counted)."""
        if self._auditor is None or keys is None:
            return AuditTally(skipped=len(audited))
        try:
            return self._auditor.check(self._store(), keys, values, outcomes, audited,
                                       layer=self._layers[item.layer], dtype=paged.tensor.dtype, req_id=item.req_id)
        except Exception as e:  # noqa: BLE001 - an audit that cannot read loses that audit, nothing else
            logger.warning("TierKVConnector: audit of %s layer %d not made: %s", item.req_id, item.layer, e)
            return AuditTally(skipped=len(audited))

    # ---- requests and shutdown ----------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM finished (now or earlier), those whose saves are all in the store."""
        with self._cond:
            self._finished_waiting |= finished_req_ids & self._planned
            done = {r for r in self._finished_waiting if not self._pending.get(r)}
            self._finished_waiting -= done
            self._planned -= done
            return done

    def waiting(self) -> set[str]:
        """Finished requests whose saves are still pending."""
        with self._cond:
            return set(self._finished_waiting)

    def wait_for(self, req_ids: set[str]) -> None:
        """Block until no save of ``req_ids`` is pending (their blocks are about to be freed)."""
        with self._cond:
            self._cond.wait_for(lambda: not any(self._pending.get(r) for r in req_ids))

    def pending(self) -> int:
        with self._cond:
            return sum(self._pending.values())

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until every queued save is in the store; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout=timeout)

    def close(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for the queued saves, abandon the rest, stop the save thread."""
        if not self.wait_all(timeout):
            logger.warning("TierKVConnector: %d save(s) still queued after %.1f s: abandoned", self.pending(),
                           timeout)
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=True)
