"""The worker's load path: fill planned blocks from the store, every layer at once or layer by layer.

A :class:`LoadJob` is one step's loads.  ``Loader.start`` takes each request's
:class:`~.probe.LoadPlan` (the chunks its probe found and leased, their keys and
tiers: read as they are, nothing is located again; a request no probe planned on
this rank is located once, by the last slice), maps the chunks that cover the
request's blocks to its block ids (a block none covers fails at once) and reads
them, in the engine's thread (whole step) or on one background thread (layer by
layer: ``wait(layer)`` returns as soon as that layer is in place).  A block that
fails to load is recorded in the job; the worker reports it to vLLM, which
recomputes it.  The loader owns its thread and its discard buffers; the engine
owns the KV cache it writes into.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tierkv.buffers import HostViews

from .metadata import LoadSpec
from .paged import Cuts, PagedLayer
from .probe import LoadPlan

if TYPE_CHECKING:
    from tierkv.store import TieredStore

logger = logging.getLogger("vllm.tierkv.loading")


@dataclass
class LoadObj:
    """One stored chunk to read: ``targets[i]`` receives block ``first+i`` (None: read and dropped).

    ``keys[s][at]`` is its key in slice ``s``, as its plan holds it (None: not planned, derived from
    ``key_hash``); ``tier`` the tier its plan found it in.
    """

    req_id: str
    salt: str | None
    key_hash: bytes
    first: int
    targets: list[int | None]
    keys: list[list[str | None]]
    at: int
    tier: str | None
    #: several KV cache groups: each group's targets (``targets`` is group 0's); None with one group
    group_targets: list[list[int | None]] | None = None

    @functools.cached_property
    def num_targets(self) -> int:
        """Blocks of the request the chunk fills, in some group (its targets are fixed once planned)."""
        if self.group_targets is None:
            return len(self.targets) - self.targets.count(None)
        return sum(any(b is not None for b in col) for col in zip(*self.group_targets))

    def targets_of(self, group: int) -> list[int | None]:
        return self.targets if self.group_targets is None else self.group_targets[group]

    def all_targets(self) -> list[int | None]:
        """Every group's targets (the blocks a failed read leaves unwritten)."""
        return self.targets if self.group_targets is None else [b for t in self.group_targets for b in t]


class _Batch:
    """What every slice of one job shares: its chunks' hashes by salt, where their blocks lie,
    and the blocks each request fills.  Made once per job; each slice then costs its keys,
    its views and the store's get."""

    __slots__ = ("blocks", "by_salt", "cuts", "discards", "members", "objs", "req_blocks")

    def __init__(self, objs: list[LoadObj], num_groups: int = 1, state_groups: frozenset[int] = frozenset()) -> None:
        self.objs = objs
        #: per KV cache group, the positions of the objects its layers read (None: all); a recurrent-state
        #: group reads only the chunks whose boundary state the load writes
        self.members: list[list[int] | None] = [
            [i for i, o in enumerate(objs) if any(b is not None for b in o.targets_of(g))] if g in state_groups
            else None for g in range(num_groups)]
        by_salt: dict[str | None, tuple[list[int], list[bytes]]] = {}
        for i, o in enumerate(objs):
            pos, hs = by_salt.setdefault(o.salt, ([], []))
            pos.append(i)
            hs.append(o.key_hash)
        #: (salt, positions, hashes); positions None when the batch has one salt
        self.by_salt = [(salt, None if len(by_salt) == 1 else pos, hs) for salt, (pos, hs) in by_salt.items()]
        #: per KV cache group: where the chunks' blocks go, how many they fill, how many are read and dropped,
        #: and how many each request fills
        self.cuts = [Cuts([o.targets_of(g) for o in self.objs_of(g)]) for g in range(num_groups)]
        self.blocks = [c.blocks for c in self.cuts]
        self.discards = [sum(len(o.targets) for o in self.objs_of(g)) - n for g, n in enumerate(self.blocks)]
        self.req_blocks: list[dict[str, int]] = []
        for g in range(num_groups):
            per: dict[str, int] = {}
            for o in self.objs_of(g):
                t = o.targets_of(g)
                per[o.req_id] = per.get(o.req_id, 0) + len(t) - t.count(None)
            self.req_blocks.append(per)

    def objs_of(self, group: int) -> list[LoadObj]:
        """The objects the layers of ``group`` read."""
        m = self.members[group]
        return self.objs if m is None else [self.objs[i] for i in m]

    def keys(self, slice_keys: Callable[[int, list[bytes], str | None], list[str]], s: int,
             group: int = 0) -> list[str]:
        """The keys of slice ``s``'s objects (of those its group reads): their plans' (the usual case), or
        derived from the chunks' hashes where a plan lacks one."""
        objs = self.objs_of(group)
        planned = [o.keys[s][o.at] for o in objs]
        if None not in planned:
            return planned  # type: ignore[return-value]  # (no None)
        if self.members[group] is not None:
            return [slice_keys(s, [o.key_hash], o.salt)[0] for o in objs]
        if len(self.by_salt) == 1:
            salt, _, hs = self.by_salt[0]
            return slice_keys(s, hs, salt)
        out: list[str] = [""] * len(self.objs)
        for salt, pos, hs in self.by_salt:
            for i, k in zip(pos, slice_keys(s, hs, salt)):  # type: ignore[arg-type]
                out[i] = k
        return out


@dataclass
class LoadJob:
    """One step's loads: per-slice events and timestamps, and what was read or failed."""

    submit_t: float
    num_slices: int
    events: list[threading.Event]
    begin: list[float]
    end: list[float]
    wait_return: list[float]
    failed_blocks: set[int] = field(default_factory=set)
    failed_reqs: set[str] = field(default_factory=set)
    future: Future | None = None
    nbytes: int = 0
    nblocks: int = 0
    ntokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    per_req: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the requests the job loads (from its start, whatever then happens to it)
    req_ids: set[str] = field(default_factory=set)
    #: requests whose chunks had to be located (no plan of theirs fits the load)
    located: set[str] = field(default_factory=set)

    @classmethod
    def new(cls, num_slices: int) -> LoadJob:
        return cls(time.perf_counter(), num_slices, [threading.Event() for _ in range(num_slices)],
                   [0.0] * num_slices, [0.0] * num_slices, [0.0] * num_slices)

    def count_hits(self, rid: str, tier: str, tokens: int) -> None:
        self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + tokens
        hits = self.per_req[rid]["hit_tokens"]
        hits[tier] = hits.get(tier, 0) + tokens

    def trace(self) -> dict[str, Any]:
        return {"submit": self.submit_t, "begin": list(self.begin), "end": list(self.end),
                "wait_return": list(self.wait_return), "blocks": self.nblocks,
                "failed_blocks": sorted(self.failed_blocks)}


class Loader:
    """Runs load jobs for one worker.

    ``locate(hashes, base, lo, hi, salt)`` plans a load no probe planned (the
    worker's prober: one batched locate of the last slice); ``slice_keys(slice,
    hashes, salt)`` the keys of chunks named by their hashes (bytes), for a key a
    plan lacks; ``store()`` the store to read (looked up on each job, so a test may
    wrap it).
    """

    def __init__(self, *, slices: list[str], paged: dict[str, PagedLayer], block_size: int,
                 store: Callable[[], TieredStore | None],
                 locate: Callable[[list[bytes], int, int, int, str | None], LoadPlan],
                 slice_keys: Callable[[int, list[bytes], str | None], list[str]],
                 tp_rank: int = 0, tp_size: int = 1, group_of: Callable[[int], int] = lambda s: 0,
                 num_groups: int = 1, state_groups: frozenset[int] = frozenset()) -> None:
        self._slices = slices
        self._state_groups = state_groups
        self._group_of = group_of
        self._num_groups = num_groups
        self._paged = paged
        self._bs = block_size
        self._store = store
        self._locate = locate
        self._slice_keys = slice_keys
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._discard: dict = {}  # buffers for bytes read and dropped (one job at a time uses them)
        self._pool: ThreadPoolExecutor | None = None
        self.layerwise = False

    def start(self, specs: list[LoadSpec], plans: Mapping[str, LoadPlan] | None = None) -> LoadJob:
        """Load the specs' blocks, each request's from its plan in ``plans`` (by request id) where one fits
        the spec (see :func:`planned`), else located."""
        job = LoadJob.new(len(self._slices))
        job.req_ids = {s.req_id for s in specs}
        plans = plans or {}
        if self.layerwise:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-load")
            job.future = self._pool.submit(self._run, job, specs, plans)
        else:
            # (in this thread; what it raises is the job's, as a background run's is: the caller settles the
            # job, and lets go of what the load held, whatever happened)
            job.future = Future()
            try:
                self._run(job, specs, plans)
                job.future.set_result(None)
            except BaseException as e:  # noqa: BLE001 - raised again where the job is settled
                job.future.set_exception(e)
        return job

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- planning -------------------------------------------------------------------
    def plan(self, job: LoadJob, specs: list[LoadSpec], plans: Mapping[str, LoadPlan]) -> list[LoadObj]:
        """The stored chunks that fill the specs' blocks (their plans', else located); blocks none covers fail
        at once."""
        objs: list[LoadObj] = []
        for spec in specs:
            lo, hi = spec.start, spec.start + len(spec.block_ids)
            job.per_req.setdefault(spec.req_id, {"tokens": 0, "bytes": 0, "hit_tokens": {}})["tokens"] += \
                (hi - lo) * self._bs
            job.nblocks += hi - lo
            if any(not spec.ids_of(g)[-1:] or spec.ids_of(g)[-1] == 0 for g in self._state_groups):
                # no block to hold the state the hit ends on: the attention blocks alone would be wrong
                lost = [b for g in range(self._num_groups) for b in spec.ids_of(g) if b != 0]
                job.failed_blocks.update(lost)
                job.failed_reqs.add(spec.req_id)
                job.count_hits(spec.req_id, "miss", (hi - lo) * self._bs)
                continue
            plan = planned(plans.get(spec.req_id), spec)
            if plan is None:
                job.located.add(spec.req_id)
                try:
                    plan = self._locate(spec.block_hashes, spec.hash_base, lo, hi, spec.cache_salt)
                except Exception as e:  # noqa: BLE001 - a broken backend is a miss
                    logger.warning("TierKVConnector: lookup failed for %s: %s", spec.req_id, e)
                    plan = None
            reach = lo
            for i, (first, last) in enumerate(plan.chunks if plan is not None else ()):
                if first >= hi:
                    break  # (a plan may reach past the blocks the scheduler loads)
                if spec.group_block_ids is None:
                    per_group = [[spec.block_ids[b - lo] if lo <= b < hi else None for b in range(first, last + 1)]]
                else:
                    per_group = [[_target(ids, b - lo) if lo <= b < hi else None for b in range(first, last + 1)]
                                 for ids in spec.group_block_ids]
                objs.append(LoadObj(spec.req_id, spec.cache_salt, plan.hashes[i], first, per_group[0],  # type: ignore[union-attr]
                                    plan.keys, i, plan.tiers[i],  # type: ignore[union-attr]
                                    per_group if spec.group_block_ids is not None else None))
                reach = last + 1
            lost = [b for g in range(self._num_groups) for b in spec.ids_of(g)[max(0, reach - lo):]
                    if spec.group_block_ids is None or b != 0]
            if lost:  # evicted since the scheduler looked: recomputed
                job.failed_blocks.update(lost)
                job.failed_reqs.add(spec.req_id)
                job.count_hits(spec.req_id, "miss", len(lost) * self._bs)
        # stagger: each tensor-parallel rank starts at a different offset
        off = (self._tp_rank * len(objs)) // max(1, self._tp_size)
        return objs[off:] + objs[:off]

    # ---- reading --------------------------------------------------------------------
    def _run(self, job: LoadJob, specs: list[LoadSpec], plans: Mapping[str, LoadPlan]) -> None:
        # the engine runs its forward in inference mode, where views of the cache are made;
        # in-place writes through such views are allowed only in inference mode (per thread)
        with torch.inference_mode():
            try:
                self._run_inner(job, specs, plans)
            finally:
                for ev in job.events:  # never leave a waiter hanging
                    ev.set()
                job.ntokens = job.nblocks * self._bs

    def _run_inner(self, job: LoadJob, specs: list[LoadSpec], plans: Mapping[str, LoadPlan]) -> None:
        objs = self.plan(job, specs, plans)
        batch = _Batch(objs, self._num_groups, self._state_groups) if objs else None
        if batch is not None:
            # which tier serves each chunk (for stats; the load itself does not depend on it), as the probe
            # (or the locate) that planned it found it
            for o in objs:
                job.count_hits(o.req_id, o.tier or "miss", o.num_targets * self._bs)
        if not self.layerwise:
            t = time.perf_counter()
            try:
                if batch is not None:
                    self._load_all_layers(job, batch)
            finally:
                for sl in range(job.num_slices):
                    job.begin[sl], job.end[sl] = t, time.perf_counter()
                    job.events[sl].set()
            return
        for sl in range(job.num_slices):
            job.begin[sl] = time.perf_counter()
            try:
                if batch is not None:
                    keys = batch.keys(self._slice_keys, sl, self._group_of(sl))
                    outs, copies, _ = self._prepare_slice(sl, batch, 0)
                    self._finish_slice(job, sl, batch, self._get(keys, outs, f"slice {sl}"), copies)
            finally:
                job.end[sl] = time.perf_counter()
                job.events[sl].set()

    def _prepare_slice(self, sl: int, batch: _Batch, spare: int) -> tuple[list, list | None, int]:
        """Destination buffers of one slice's chunks, and their pending copies (None: none).

        Blocks of a chunk this request has, or does not need, are read into discard
        buffers; ``spare`` of them are already taken by other layers of the same get.
        """
        paged = self._paged[self._slices[sl]]
        g = self._group_of(sl)
        n = batch.discards[g]
        if n:
            discard = iter(paged.discard_targets(spare + n, self._discard)[spare:])
            outs, copies = paged.cut(batch.cuts[g], lambda: next(discard))
        else:
            outs, copies = paged.cut(batch.cuts[g], _no_discards)
        return outs, copies, n

    def _get(self, keys: list[str], outs: list, what: str) -> list[bool]:
        store = self._store()
        if store is None:  # (shut down meanwhile: nothing is read)
            return [False] * len(keys)
        try:
            return store.get(keys, outs)
        except Exception as e:  # noqa: BLE001 - a broken backend is a miss
            logger.warning("TierKVConnector: get failed for %s: %s", what, e)
            return [False] * len(keys)

    def _finish_slice(self, job: LoadJob, sl: int, batch: _Batch, ok: list[bool], copies: list | None) -> None:
        nb = self._paged[self._slices[sl]].block_nbytes
        g = self._group_of(sl)
        if copies is None and all(ok):  # the common case: every chunk in place, nothing to copy
            job.nbytes += nb * batch.blocks[g]
            for rid, n in batch.req_blocks[g].items():
                job.per_req[rid]["bytes"] += nb * n
            return
        for j, (o, good) in enumerate(zip(batch.objs_of(g), ok)):
            if good:
                if copies is not None:
                    for stage, dst in copies[j]:
                        dst.copy_(stage)
                t = o.targets_of(g)
                job.nbytes += nb * (len(t) - t.count(None))
                job.per_req[o.req_id]["bytes"] += nb * (len(t) - t.count(None))
            else:
                # a block of any group computed from this chunk is stale: report every group's
                job.failed_blocks.update(b for b in o.all_targets() if b is not None)
                job.failed_reqs.add(o.req_id)

    def _load_all_layers(self, job: LoadJob, batch: _Batch) -> None:
        """Every slice in one get: the tiers batch it as a whole (one round trip, one I/O queue)."""
        L = job.num_slices
        keys: list[str] = []
        per_layer: list = []
        copies: list = []
        spare = 0
        for sl in range(L):
            keys += batch.keys(self._slice_keys, sl, self._group_of(sl))
            o, c, used = self._prepare_slice(sl, batch, spare)
            spare += used
            per_layer.append(o)
            copies.append(c)
        if all(type(o) is HostViews for o in per_layer):  # (views with their addresses: taken on trust)
            outs: list = HostViews.join(per_layer)
        else:
            outs = [v for o in per_layer for v in o]
        ok = self._get(keys, outs, "all layers")
        at = 0
        for sl in range(L):
            n = len(batch.objs_of(self._group_of(sl)))
            self._finish_slice(job, sl, batch, ok[at:at + n], copies[sl])
            at += n


def planned(plan: LoadPlan | None, spec: LoadSpec) -> LoadPlan | None:
    """``plan`` when it is the plan of ``spec``'s load, else None (the load locates its chunks).

    It is when its probe started where the load starts, under the same salt, and every chunk of it
    the load reaches is named by the spec's hash of that chunk's last block: equal hashes name equal
    prefixes, so the plan's keys are the load's keys (a request looked up again since, at another
    point, has another plan or none).
    """
    if plan is None or plan.local != spec.start or plan.salt != spec.cache_salt:
        return None
    hi, base, hashes = spec.start + len(spec.block_ids), spec.hash_base, spec.block_hashes
    for (first, last), h in zip(plan.chunks, plan.hashes):
        if first >= hi:
            break
        at = last - base
        if not 0 <= at < len(hashes) or hashes[at] != h:
            return None
    return plan


def _target(ids: list[int], i: int) -> int | None:
    """Block ``i`` of a request's ids as a load target: vLLM's null block (id 0, a sliding-window block out of
    the window) is never written."""
    b = ids[i]
    return None if b == 0 else b


def _no_discards() -> list:
    raise AssertionError("a chunk without discarded blocks asked for a discard buffer")
