"""The connector's scheduler side: how many tokens to load, and the plans shipped to the workers.

``get_num_new_matched_tokens`` counts the leading blocks the store holds (for
every layer of every KV-head shard) beyond what vLLM holds locally: whole blocks
only, and never the prompt's last token.  ``update_state_after_alloc`` records
the block ids to fill; ``build_connector_meta`` turns each scheduled request into
a step's load and save plans; ``request_finished`` keeps a finished request's
blocks while saves still read them.

With ``load_async`` a hit is loaded between steps: vLLM parks the request
(``WAITING_FOR_REMOTE_KVS``), the load goes out in the same step's metadata
(``async_loads``) and the workers report it done through ``get_finished``; a
request whose load failed is recomputed from the failed block, and a lookup of it
after that is a miss once (a medium that keeps failing must not send the request
round the same failed load for ever).  With ``load_async: "auto"`` (the default) the first hit
a step admits loads in that step when every block of it sits in a memory tier
(locality ``device`` or ``host``) and it is at most ``load_inline_max_tokens``
long: a request arriving alone starts at once instead of waiting a step for its
load, while the batch waits for one memory-speed load a step at most; every other
hit of the step (and any hit from disk or a remote tier) loads between steps.

A share ``audit_rate`` of the requests that would hit is audited (:class:`AuditPace`):
the hit is served as a miss, vLLM computes it, and the save plans carry the audited
blocks (``SaveSpec.audit``) so that the workers compare what they computed with the
chunks stored (audit.py).

The store lives with the workers; a request's question goes to them as a
``ProbeRequest`` (service.py) through ``ask`` (the lookup channel of lookup.py by
default), one rank per KV-head shard, and the smallest answer wins.  An
unreachable worker is a miss for a while, never a crash.  What the scheduler keeps
per request is two dataclasses: the last lookup's verdict (:class:`Lookup`, from
``get_num_new_matched_tokens`` to ``update_state_after_alloc``) and the request's
state between steps (:class:`RequestState`).  The scheduler owns no store and no
engine memory.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent

from tierkv.outcome import MissReason

from .chunks import plan_saves
from .config import ConnectorOptions, EngineInfo, RequestSalts
from .connector_stats import TierKVConnectorStats
from .decline import COUNTERS as DECLINE_COUNTERS
from .decline import DeclineBook, Decliner, Verdict
from .groups import GroupKind
from .kv_events import BlockEvents
from .lookup import ChannelClient, endpoint
from .metadata import LoadSpec, SaveSpec, TierKVConnectorMetadata
from .service import Channel, ProbeAnswer, ProbeRequest, ShutdownRequest, TierPlace

try:  # vLLM >= 0.32
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older engines
    CacheHitSource = None  # type: ignore[assignment, misc]

logger = logging.getLogger("vllm.tierkv.scheduler")

#: how long lookups are skipped (every request a miss) after one failed
LOOKUP_BACKOFF_S = 10.0

#: tiers a hit may be loaded from inside the step with ``load_async: "auto"`` (memory speed)
INLINE_LOCALITIES = frozenset({"device", "host"})

#: ask(tp_rank, request) -> that rank's worker's answer (see service.py)
Ask = Callable[[int, ProbeRequest], ProbeAnswer]


def hit_source(locality: str | None):
    """vLLM's cache-hit source for a tier of ``locality`` (declared by the tier, see tiers/base.py)."""
    if CacheHitSource is None:
        return None
    return {
        "device": CacheHitSource.DEVICE,
        "host": CacheHitSource.HOST,
        "remote": CacheHitSource.P2P,
        "disk": CacheHitSource.DISK,
    }.get(locality or "", CacheHitSource.EXTERNAL_UNSPECIFIED)


@dataclass(frozen=True)
class Lookup:
    """A request's last lookup, kept from ``get_num_new_matched_tokens`` to ``update_state_after_alloc``."""

    #: blocks vLLM holds, and the blocks past them the hit loads
    local: int
    hits: int
    #: blocks known stored from block 0 (no save needed below it)
    stored: int
    #: the hit loads between steps
    is_async: bool
    #: where each block of the reach from ``local`` is (None: unknown)
    where: list[TierPlace | None]
    #: blocks past ``local`` that would have hit, served as a miss for an audit (0: no audit)
    audit: int = 0
    #: the decline rule's verdict on the hit (None: not asked)
    verdict: Verdict | None = None


@dataclass
class RequestState:
    """What the scheduler side tracks for one request between steps."""

    request: Any
    #: the request's block ids, one list per KV cache group (one list for most models)
    block_ids: list[list[int]] = field(default_factory=list)
    #: the first chunk not saved (nor known stored), and one past the longest tail saved
    next_chunk: int = 0
    tail_end: int = 0
    #: blocks vLLM should have computed by the next step; fewer means it rolled back
    expect_done: int = 0
    pending_load: tuple[int, int] | None = None
    #: the pending load runs between steps (vLLM parks the request until it is done)
    load_async: bool = False
    hit_sources: dict[Any, int] = field(default_factory=dict)
    #: blocks ``lo .. hi-1`` are computed for an audit: their saves compare with the stored chunks
    audit: tuple[int, int] | None = None


@dataclass
class SchedulerTotals:
    """Lookups made, tokens hit, and hit tokens by tier name (since the scheduler started)."""

    lookups: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    #: chunks not saved because a group had freed a block of them (sliding windows of a hybrid model)
    chunks_unsavable: int = 0
    #: hits served as misses for an audit (``audit_rate``), and their tokens (recomputed instead of loaded)
    audited_requests: int = 0
    audited_tokens: int = 0
    #: hits (and their tokens) not claimed because their tier loads slower than vLLM computes, by the tier that
    #: cut them, and slow hits claimed anyway as probes (decline.py: its DeclineBook counts into these)
    declined_slow: dict[str, int] = field(default_factory=dict)
    declined_slow_tokens: dict[str, int] = field(default_factory=dict)
    decline_probes: dict[str, int] = field(default_factory=dict)


class TierKVScheduler:
    """Scheduler-side logic of ``TierKVConnector`` (one per engine)."""

    def __init__(self, options: ConnectorOptions, info: EngineInfo, ask: Ask | None = None) -> None:
        self.options = options
        self.info = info
        self._bs = info.block_size
        self._chunk_blocks = max(1, options.chunk_tokens // info.block_size)
        #: several KV cache groups (a hybrid model): block ids per group, loads between steps only
        self._multi = info.num_groups > 1
        #: a sliding-window group frees blocks before its window while the request runs: saves skip them
        self._windowed = any(g.kind is GroupKind.SLIDING_WINDOW for g in info.groups)
        #: recurrent-state groups: a hit ends on a boundary whose state was saved, and a state is saved in the
        #: step that ends on its boundary
        self._state_groups = sorted(info.state_groups)
        self._clients: dict[int, ChannelClient] = {}
        self._ask = ask or self._ask_worker
        self._lookup_down_until = 0.0
        self.requests: dict[str, RequestState] = {}
        #: request id -> its last lookup
        self._lookups: dict[str, Lookup] = {}
        #: loads between steps not yet reported done: request id -> the blocks they fill
        self._async_in_flight: dict[str, set[int]] = {}
        #: requests an async load failed for: their next lookup is a miss
        self._async_failed: set[str] = set()
        self._planned_saves: set[str] = set()
        #: hits this step (since the last build_connector_meta) loads in the step under load_async "auto"
        self._inline_this_step = 0
        #: request id -> whether its hits are audited (drawn at its first lookup that hits, kept until it ends)
        self._audit_draws: dict[str, bool] = {}
        self._audit_pace = AuditPace(options.audit_rate)
        #: each request's key salt: its cache_salt and its LoRA adapter's identity (config.py)
        self._salts = RequestSalts()
        #: the block hashes of planned chunks, for vLLM's KV events (None: vLLM publishes no events)
        self.block_events: BlockEvents | None = BlockEvents(info.block_size) if info.kv_events else None
        #: requests whose last lookup leased chunks in the workers and no load was planned for yet
        self._leased: set[str] = set()
        #: of those, the ones no load will read: released in the next step's metadata
        self._lease_releases: set[str] = set()
        self.totals = SchedulerTotals()
        #: load time against compute time, from the workers' reports (None: every hit is claimed)
        self.declines = DeclineBook(Decliner(options.decline_bias, options.decline_probe_share,
                                             options.decline_margin_ms / 1000.0),
                                    {k: getattr(self.totals, k) for k in DECLINE_COUNTERS}) \
            if options.decline_slow_hits else None
        #: (request id, tokens its last lookup found not stored, by ``MissReason``): what a trace records
        self.last_missed: tuple[Any, dict[str, int]] = (None, {})

    # ---- asking the workers -------------------------------------------------------
    def _ask_worker(self, tp_rank: int, request: ProbeRequest) -> ProbeAnswer:
        c = self._clients.get(tp_rank)
        if c is None:
            path, key = endpoint(self.info.engine_id, self.info.dp_rank, tp_rank, Channel.LOOKUP)
            c = self._clients[tp_rank] = ChannelClient(path, key)
        answer = c.call(request)
        if not isinstance(answer, ProbeAnswer):
            raise TypeError(f"worker {tp_rank} answered a probe with a {type(answer).__name__}")
        return answer

    def _shard_ranks(self) -> list[int]:
        """One tensor-parallel rank per KV-head shard (the first replica)."""
        s = self.info.shard
        return [i * s.replicas for i in range(s.num_shards)]

    def hash_window(self, request: Any, lo: int, hi: int) -> tuple[list[bytes], int]:
        """The request's block hashes that name the chunks around ``lo..hi-1``, and the first one's index."""
        chunk_blocks = self._chunk_blocks
        base = (lo // chunk_blocks) * chunk_blocks
        top = min(len(request.block_hashes), -(-hi // chunk_blocks) * chunk_blocks)
        return [bytes(h) for h in request.block_hashes[base:top]], base

    def probe(self, request: Any, local: int, limit: int | None = None) -> ProbeAnswer:
        """A request's whole lookup in one round trip per KV-head shard (``ProbeRequest``): the smallest
        ``reach`` and ``held`` of the shards, and where each reached block is, from the first shard.
        With ``lease_timeout_s`` each shard's worker holds what it reports until the load (``leased``: the
        objects held, over the shards)."""
        hashes = [bytes(h) for h in request.block_hashes[:limit]]
        rid = request.request_id if self.options.lease_timeout_s else None
        ask = ProbeRequest(hashes, local, self._salts.of(request), str(request.request_id))
        reach, held, where, leased = max(0, len(hashes) - local), local, [], 0
        missed: dict[str, int] = {}
        try:
            for i, rank in enumerate(self._shard_ranks()):
                got = self._ask(rank, ask)
                if i == 0 or got.reach < reach:  # (the misses of the shard that reached least)
                    missed = got.missed
                reach, held, leased = min(reach, got.reach), min(held, got.held), leased + got.leased
                if i == 0:
                    where = got.where
        finally:
            if rid is not None:  # (a shard that answered may hold a lease even when another failed)
                self._leased.add(rid)
        return ProbeAnswer(reach, held, where[:reach], leased, missed)

    # ---- vLLM's scheduler hooks -----------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.options.load:
            return 0, False
        bs = self._bs
        hashes = request.block_hashes
        # leave at least one token to compute: vLLM needs its logits.  By default the
        # hit is whole blocks, so a prompt stored in full recomputes its last block
        # (vLLM's own rule); with full_hit_recompute="token" that block is loaded too
        # and only the prompt's last token is computed (its KV overwrites the loaded
        # copy of itself: the same token at the same position after the same prefix).
        # (a recurrent state exists at block boundaries only: with state groups a hit is whole blocks)
        token_mode = self.options.full_hit_recompute == "token" and not self._state_groups
        max_blocks = min(len(hashes), (request.num_tokens - (0 if token_mode else 1)) // bs)
        local = num_computed_tokens // bs
        hits, held, reach = 0, 0, 0
        where: list[TierPlace | None] = []
        missed: dict[str, int] = {}
        if time.monotonic() >= self._lookup_down_until and (local or len(hashes) > local):
            try:
                # one round trip: how far the full blocks are stored from ``local`` on (what is stored past
                # max_blocks needs no save), whether the store already holds what vLLM has locally (decides
                # what to save), and which tier holds each block of the hit (statistics)
                # with recurrent-state groups the hit's last block must be one the hit may end on: the probe
                # asks no further than that (the state at its boundary decides where the hit ends)
                got = self.probe(request, local, max_blocks if self._state_groups else None)
                reach, held, where, missed = got.reach, got.held, got.where, got.missed
                hits = max(0, min(reach, max_blocks - local))
            except Exception as e:  # noqa: BLE001 - an unreachable worker is a miss, never a crash
                # do not stall scheduling on it: treat everything as a miss for a while
                self._lookup_down_until = time.monotonic() + LOOKUP_BACKOFF_S
                logger.warning("TierKVConnector: lookup failed (%s); misses for the next %.0f s", e,
                               LOOKUP_BACKOFF_S)
                hits, held, reach, where = 0, 0, 0, []
                missed = {str(MissReason.UNAVAILABLE): max(0, len(hashes) - local)}
        #: the blocks of this lookup the store did not serve, by reason (a trace records them)
        self.last_missed = (request.request_id, {r: n * bs for r, n in missed.items() if n})
        # what is in the store needs no save: from the first block it lacks
        stored = held if held < local else local + reach
        if request.request_id in self._async_failed:
            # its load failed (an error, or a chunk gone since the lookup): recompute it this time,
            # and save what it computes
            self._async_failed.discard(request.request_id)
            hits, stored = 0, min(stored, local)
        verdict = None
        if hits and self.declines is not None:
            # a hit that loads slower than vLLM computes it is not claimed, from its slow tier's first block on
            tiers = [p.tier if p is not None else None for p in _padded(where, hits)]
            verdict = self.declines.decliner.decide(tiers, bs)
            hits = verdict.blocks
        audit = 0
        if hits and self._audited(request.request_id):
            # served as a miss: vLLM computes these blocks, the workers save them, and each save that
            # finds its chunk stored compares the fresh bytes with it (saving.py)
            audit, hits, stored = hits, 0, min(stored, local)
        if hits == 0:
            self._release_lease(request.request_id)  # nothing to load: nothing to hold
        self.totals.lookups += 1
        ext = hits * bs
        if (local + hits) * bs >= request.num_tokens:  # only with full_hit_recompute="token"
            ext = max(0, request.num_tokens - 1 - local * bs)
        # (vLLM: never async with nothing to load; a block whose tier is unknown counts as a slow one)
        # several groups: vLLM takes a failed load back per request only from a load between steps
        is_async = ext > 0 and (self._multi or self._loads_between_steps(ext, _padded(where, hits)))
        self._lookups[request.request_id] = Lookup(local, hits, stored, is_async, where, audit, verdict)
        return ext, is_async

    def _audited(self, rid: str) -> bool:
        """Whether request ``rid``'s hits are audited: drawn once per request, at ``audit_rate``.

        Only while saves are on: the comparison is made by the save that finds the chunk stored.
        """
        if self.options.audit_rate <= 0.0 or not self.options.save:
            return False
        drawn = self._audit_draws.get(rid)
        if drawn is None:
            drawn = self._audit_draws[rid] = self._audit_pace.next()
        return drawn

    def _loads_between_steps(self, ext: int, where: list[TierPlace | None]) -> bool:
        """Whether a hit of ``ext`` tokens served from ``where`` (one place per block) loads between steps."""
        mode = self.options.load_async
        if mode != "auto":
            return bool(mode)
        inline = (self._inline_this_step == 0 and ext <= self.options.load_inline_max_tokens
                  and all(w is not None and w.locality in INLINE_LOCALITIES for w in where))
        if inline:
            self._inline_this_step += 1
        return not inline

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        st = self.requests.get(rid)
        if st is None:
            st = self.requests[rid] = RequestState(request=request)
        st.request = request
        look = self._lookups.pop(rid, None)
        if look is None:
            return
        local, stored = look.local, look.stored
        bs = self._bs
        num_external_tokens = max(0, int(num_external_tokens))
        st.next_chunk, st.tail_end = stored // self._chunk_blocks, stored
        # blocks complete once these tokens are in (a hit one token short of the
        # prompt's end leaves its last block incomplete until that token is computed)
        st.expect_done = local + num_external_tokens // bs
        st.pending_load = None
        st.load_async = False
        st.hit_sources = {}
        st.audit = (local, local + look.audit) if look.audit else None
        if look.verdict is not None and self.declines is not None:
            self.declines.count(look.verdict)
        if look.audit:
            self.totals.audited_requests += 1
            self.totals.audited_tokens += look.audit * bs
        n_ext = -(-num_external_tokens // bs)  # blocks to load, the last one perhaps for all but a token
        if n_ext <= 0:
            self._release_lease(rid)
            return
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        st.pending_load = (local, local + n_ext)
        st.load_async = look.is_async
        # which tier will serve the hit (for stats and vLLM's cache-hit sources), as the lookup found it
        by_tier = self.totals.hit_tokens_by_tier
        for i, place in enumerate(_padded(look.where, n_ext)):
            name, locality = (place.tier, place.locality) if place is not None else ("unknown", None)
            n = min(bs, num_external_tokens - i * bs)  # hit tokens of this block
            by_tier[name] = by_tier.get(name, 0) + n
            src = hit_source(locality)
            if src is not None:
                st.hit_sources[src] = st.hit_sources.get(src, 0) + n
        self.totals.hit_tokens += num_external_tokens

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict | None:
        """Hit tokens by source, or None when they do not add up (the caller falls back)."""
        if num_external_tokens == 0:
            return {}
        st = self.requests.get(request.request_id)
        if st is None or sum(st.hit_sources.values()) != num_external_tokens:
            return None
        return dict(st.hit_sources)

    def _release_lease(self, rid: str) -> None:
        """The request's last lookup will not be loaded: its workers let go of what it leased (next step)."""
        if rid in self._leased:
            self._leased.discard(rid)
            self._lease_releases.add(rid)

    def build_connector_meta(self, scheduler_output: Any) -> TierKVConnectorMetadata:
        meta = TierKVConnectorMetadata(preempted=set(scheduler_output.preempted_req_ids or ()))
        if self._lease_releases:
            meta.lease_releases, self._lease_releases = self._lease_releases, set()
        if meta.preempted and self._leased:  # (the workers let go of a preempted request's leases themselves)
            self._leased -= meta.preempted
        self._inline_this_step = 0  # (called once per schedule(): the next lookups are the next step's)
        meta.step_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        bs = self._bs
        computed: dict[str, int] = {}
        for nr in scheduler_output.scheduled_new_reqs:
            st = self.requests.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in nr.block_ids]
            computed[nr.req_id] = nr.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.requests.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not st.block_ids:
                    st.block_ids = [[] for _ in new_ids]
                for mine, ids in zip(st.block_ids, new_ids):
                    mine.extend(ids)
            computed[rid] = cached.num_computed_tokens[i]

        # loads between steps: their requests are parked, not scheduled
        for rid, st in self.requests.items():
            if st.pending_load is None or not st.load_async or rid in computed:
                continue
            lo, hi = st.pending_load
            st.pending_load, st.load_async = None, False
            meta.async_loads.append(self._load_spec(st, lo, hi))
            self._leased.discard(rid)  # (the workers let go of it once the load is over)
            self._async_in_flight[rid] = {b for ids in st.block_ids for b in ids[lo:hi]}
            # the workers no longer hold saves of an earlier life of it (before a preemption):
            # the blocks wait for this load's report only
            self._planned_saves.discard(rid)

        for rid, num_computed in computed.items():
            st = self.requests[rid]
            req = st.request
            if st.pending_load is not None:
                lo, hi = st.pending_load
                st.pending_load = None
                meta.loads.append(self._load_spec(st, lo, hi))
                self._leased.discard(rid)
            if not self.options.save:
                continue
            chunk_blocks = self._chunk_blocks
            done = num_computed // bs
            if done < st.expect_done:  # vLLM rolled back (a failed load, a preemption): save again from there
                st.next_chunk = min(st.next_chunk, done // chunk_blocks)
                st.tail_end = min(st.tail_end, done)
            new_tokens = num_computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            st.expect_done = new_tokens // bs
            end = min(new_tokens // bs, len(req.block_hashes), *(len(ids) for ids in st.block_ids or [[]]))
            # the step that completes the prompt also saves its blocks after the last full chunk
            prefilled = num_computed < req.num_prompt_tokens <= new_tokens
            chunks, st.next_chunk, st.tail_end = plan_saves(st.next_chunk, st.tail_end, end, prefilled, chunk_blocks)
            if chunks and self._windowed:
                chunks = self._savable(st, chunks, num_computed)
            if not chunks:
                continue
            per_group = [[ids[a:b + 1] for a, b in chunks] for ids in st.block_ids]
            state_chunks = self._offered_states(st, chunks, new_tokens) if self._state_groups else None
            if self.block_events is not None:
                self.block_events.plan(req, chunks)
            meta.saves.append(SaveSpec(
                rid,
                chunks,
                per_group[0],
                [bytes(req.block_hashes[b]) for _, b in chunks],
                [b for ids in st.block_ids for b in ids[:end]] if self._multi else list(st.block_ids[0][:end]),
                self._salts.of(req),
                per_group if self._multi else None,
                audit=st.audit,
                state_chunks=state_chunks,
            ))
            self._planned_saves.add(rid)
        return meta

    def _offered_states(self, st: RequestState, chunks: list[tuple[int, int]], new_tokens: int) -> list[int]:
        """Positions in ``chunks`` whose recurrent state this step offers: the step ends exactly on the chunk's
        last block boundary, and every state group holds a block there (vLLM keeps the state at a boundary only
        where a step ends; its block is freed or overwritten in a later step)."""
        bs = self._bs
        if new_tokens % bs:
            return []
        last = new_tokens // bs - 1
        return [j for j, (_, b) in enumerate(chunks)
                if b == last and all(b < len(st.block_ids[g]) and st.block_ids[g][b] != 0
                                     for g in self._state_groups)]

    def _load_spec(self, st: RequestState, lo: int, hi: int) -> LoadSpec:
        """Load the request's blocks ``lo .. hi-1`` (in every group; in a recurrent-state group, the state at the
        boundary of block ``hi-1`` alone, into that block: vLLM continues from it)."""
        hashes, base = self.hash_window(st.request, lo, hi)
        per_group = [ids[lo:hi] for ids in st.block_ids]
        for g in self._state_groups:
            # (id 0, vLLM's null block, is never written: the blocks before the boundary are not loaded)
            per_group[g] = [0] * (len(per_group[g]) - 1) + per_group[g][-1:]
        return LoadSpec(st.request.request_id, lo, per_group[0], hashes, self._salts.of(st.request), base,
                        per_group if self._multi else None)

    def _savable(self, st: RequestState, chunks: list[tuple[int, int]], num_computed: int) -> list[tuple[int, int]]:
        """The chunks every group still holds: a sliding-window group frees the blocks before its window
        (vLLM's null block, id 0, takes their place), and a chunk one of its groups lost is not saved
        (a hit needs it in every layer).  A request computed in one step keeps every block of it."""
        out = []
        for a, b in chunks:
            ok = True
            for g, ids in enumerate(st.block_ids):
                lo, _ = self.info.groups[g].live_blocks(num_computed)
                if a < lo or 0 in ids[a:b + 1]:
                    ok = False
                    break
            if ok:
                out.append((a, b))
            else:
                self.totals.chunks_unsavable += 1
        return out

    def update_connector_output(self, output: Any) -> None:
        """The workers' report of a step: which async loads are done, which blocks failed."""
        bad = getattr(output, "invalid_block_ids", None) or ()
        if bad:
            for rid, blocks in self._async_in_flight.items():
                if not blocks.isdisjoint(bad):
                    self._async_failed.add(rid)
        # several groups: a failed load between steps comes back per request (vLLM recomputes it)
        self._async_failed.update(getattr(output, "failed_recving", None) or ())
        for rid in getattr(output, "finished_recving", None) or ():
            self._async_in_flight.pop(rid, None)
        if self.block_events is not None:
            self.block_events.add(getattr(output, "kv_cache_events", None))
        if self.declines is not None:
            self.declines.observe(getattr(output, "kv_connector_stats", None))

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's KV events for the chunks the workers reported stored or removed since the last call."""
        return self.block_events.take() if self.block_events is not None else []

    def take_event_stats(self) -> TierKVConnectorStats | None:
        """The events published and dropped and the hits declined since the last call, as connector stats (None:
        none)."""
        stats = TierKVConnectorStats()
        if self.declines is not None:
            stats.data.update(self.declines.take())
        n = self.block_events.take_counts() if self.block_events is not None else None
        if n is not None and (n.stored or n.removed or n.dropped):
            stats.data.update(events_stored=n.stored, events_removed=n.removed, events_dropped=n.dropped)
        return None if stats.is_empty() else stats

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """``(delay_free, None)``: blocks stay allocated until every worker reports the request's saves done.

        A request finished during its async load has no saves (it never ran since): vLLM itself
        keeps its blocks until the workers report the load (``finished_recving``).
        """
        rid = request.request_id
        self.requests.pop(rid, None)
        self._lookups.pop(rid, None)
        self._async_failed.discard(rid)
        self._audit_draws.pop(rid, None)
        self._release_lease(rid)  # finished or aborted before its load
        delay = rid in self._planned_saves
        self._planned_saves.discard(rid)
        return delay, None

    # ---- lifecycle ----------------------------------------------------------------
    def ask_workers_to_shut_down(self) -> None:
        """Tell every rank's worker to drain and close now (the engine is going down); waits for none."""
        for rank in range(self.info.tp_size):
            try:
                path, key = endpoint(self.info.engine_id, self.info.dp_rank, rank, Channel.LIFECYCLE)
                c = ChannelClient(path, key, connect_timeout=0.2)
                try:
                    c.post(ShutdownRequest())
                finally:
                    c.close()
            except Exception:  # noqa: BLE001 - gone already, or never started
                pass

    def shutdown(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()


class AuditPace:
    """Which requests that would hit are audited: a share ``rate`` of them, neither early nor in step.

    Each request adds ``rate`` to a credit; one is audited when the credit reaches a threshold, which
    is then spent and drawn again, uniformly between 0.5 and 1.5 (mean 1, so ``rate`` is the long-run
    share).  The first threshold is 1: the first audit is the ``ceil(1 / rate)``-th request, never a
    chance early one; the drawn thresholds keep the audits out of step with a workload that cycles
    through its prompts.  The draws are seeded: a run is reproducible.  ``rate`` 1 audits every one.
    """

    def __init__(self, rate: float, seed: int = 0x7A5D17) -> None:
        self.rate = rate
        self._credit = 0.0
        self._threshold = 1.0
        self._rng = random.Random(seed)

    def next(self) -> bool:
        """Whether the next request is audited."""
        if self.rate >= 1.0:
            return True
        if self.rate <= 0.0:
            return False
        self._credit += self.rate
        if self._credit + 1e-12 < self._threshold:
            return False
        self._credit -= self._threshold
        self._threshold = self._rng.uniform(0.5, 1.5)
        return True


def _padded(where: list[TierPlace | None], n: int) -> list[TierPlace | None]:
    """``where``'s first ``n`` places, None past its end (a block whose tier is unknown)."""
    return (where[:n] + [None] * n)[:n]
