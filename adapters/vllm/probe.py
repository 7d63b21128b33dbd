"""What a worker's store holds of a request: the scheduler's probe, and the plan its load reads.

The parts index *slices* (a layer, or one stored KV-head shard of it: layer_keys.py).
Both questions are answered in one pass over the store (see chunks.py for which
objects hold which blocks).  A chunk is stored when every slice holds its object.
A pass asks the store in two *levels*, each one batched ``locate`` of every key
the level needs, and keeps the answers per chunk:

1. the last slice's keys of every full chunk the question can reach, and of the
   tails that may end it (the first and the last chunk's), answered with the tier
   holding each: the last slice is written last, so a chunk it lacks is not
   stored, and a miss costs this one call;
2. the other slices' keys of the chunks the last slice holds, answered per chunk
   (does every other slice hold it), with every slice's keys of the tails of a
   chunk where the last slice's run broke early.

A call after those is made only when an answer moved the end of the run to a chunk
whose tails were not asked yet (a slice missing a chunk the last slice holds).
Each key is hashed once per pass and asked about once; the tier of each chunk
comes from the same answers.  A probe answers both of its questions (the blocks
held below ``local`` and the reach from it) from one pass, and its
:class:`LoadPlan` (the chunks of the reach, every slice's key, their tiers) is
what its lease holds and its load reads: a hit is resolved once.

Nothing here keeps state between passes: a pass is a question's scratch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, compress, groupby, repeat
from operator import itemgetter, not_
from typing import TYPE_CHECKING, Any

from tierkv.outcome import MissReason

from .chunks import Chunk, covered, resolve, tail_candidates
from .layer_keys import LayerKeys
from .service import ProbeAnswer, ProbeRequest, TierPlace

if TYPE_CHECKING:
    from tierkv.store import TieredStore

_UNKNOWN: Any = object()  # not asked yet (an answer is a tier name, or None: absent)


def _index(values: list, target: Any, stop: int) -> int:
    """Position of the first ``target`` in ``values[:stop]`` (compared in C), or ``stop``."""
    try:
        return values.index(target, 0, stop)
    except ValueError:
        return stop


def _unknown(ends: list[int], vals: list, lo: int, hi: int) -> list[int]:
    """The ends of ``lo .. hi-1`` whose answer is unknown (all of them, the usual case, in one slice)."""
    if vals[lo:hi].count(_UNKNOWN) == hi - lo:
        return ends[lo:hi]
    return [e for e, v in zip(ends[lo:hi], vals[lo:hi]) if v is _UNKNOWN]


def _merged(parts: list[list[int]]) -> list[int]:
    """The ends of every list, each once, in order (two windows may want the same chunk)."""
    return parts[0] if len(parts) == 1 else list(dict.fromkeys(chain(*parts)))


class _Pass:
    """One question's answers from the store, asked for in batches (one ``locate`` per level).

    ``hashes[i]`` names block ``base + i``; ``slices`` are the slices that must
    hold a chunk, the first of them (the last slice) asked alone in the first
    level, the others together in the second.
    """

    def __init__(self, keys: LayerKeys, store: TieredStore, hashes: Sequence[bytes], base: int, salt: str | None,
                 slices: list[int], chunk_blocks: int) -> None:
        self._keys, self._store = keys, store
        self._hashes, self._base, self._salt = hashes, base, salt
        self.chunk_blocks = chunk_blocks
        self.known = base + len(hashes)  # blocks with a hash: an object ending past them cannot be named
        self._first, self._others = slices[0], slices[1:]
        #: chunk end -> the tier holding the first slice's object (None: none)
        self.first: dict[int, str | None] = {}
        #: chunk end -> whether every other slice holds its object
        self.others: dict[int, bool] = {}
        #: the first slice's key of each chunk end asked about
        self.first_keys: dict[int, str] = {}
        self._ask_first: list[list[int]] = []
        self._ask_others: list[list[int]] = []
        self.calls = 0
        #: every key asked about, by batch: ``(slice, chunk ends, keys)`` (a plan's keys come from them)
        self.asked: list[tuple[int, list[int], list[str]]] = []

    def fetch(self) -> bool:
        """Ask the store about every key wanted since the last call, in one call; False when none is."""
        if not self._ask_first and not self._ask_others:
            return False
        first = _merged(self._ask_first) if self._ask_first else []
        others = _merged(self._ask_others) if self._ask_others else []
        self._ask_first, self._ask_others = [], []
        hashes, base, salt = self._hashes, self._base, self._salt
        keys = self._keys.keys(self._first, [hashes[e - base] for e in first], salt) if first else []
        self.first_keys.update(zip(first, keys))
        if first:
            self.asked.append((self._first, first, keys))
        if others:
            hs = [hashes[e - base] for e in others]  # (one conversion for every slice)
            parts = [keys]
            for s in self._others:
                got = self._keys.keys(s, hs, salt)
                self.asked.append((s, others, got))
                parts.append(got)
            keys = list(chain.from_iterable(parts))
        tiers = self._store.locate(keys)
        self.calls += 1
        n = len(first)
        self.first.update(zip(first, tiers[:n]))
        if others:
            m = len(others)
            held = [True] * m
            for at in range(n, len(tiers), m):
                row = tiers[at:at + m]
                if None in row:  # (rare: a slice lost a chunk the last slice holds)
                    for i, t in enumerate(row):
                        if t is None:
                            held[i] = False
            self.others.update(zip(others, held))
        return True

    # ---- one window's chunks, as chunks.resolve defines them ----------------------------
    def window(self, lo: int, hi: int) -> list[Chunk] | None:
        """The stored chunks covering the leading blocks of ``lo .. hi-1`` (``chunks.resolve`` over the answers
        so far), or None while answers are missing (then they are asked for: :meth:`fetch` them, call again)."""
        settled = True

        def full_present(ends: list[int]) -> int:
            nonlocal settled
            if self.first.get(ends[0], _UNKNOWN) is _UNKNOWN:
                # the first level: also ask the tails of the first chunk, so that a miss costs one call
                self._ask_first.append(tail_candidates(lo // self.chunk_blocks, lo, hi, self.known,
                                                                self.chunk_blocks))
            n, done = self._leading(ends)
            settled = settled and done
            return n

        def tail_present(cands: list[int]) -> int | None:
            nonlocal settled
            j, done = self._first_stored(cands)
            settled = settled and done
            return j

        found = resolve(lo, hi, self.known, self.chunk_blocks, full_present, tail_present)
        return found if settled else None

    def _leading(self, ends: list[int]) -> tuple[int, bool]:
        """How many leading ``ends`` every slice holds, and whether that is settled (every answer in).

        Unsettled, the count is what the answers so far allow (a chunk not yet
        asked about counts as held) and the missing answers are asked for: the
        first slice's of every chunk, the others' where the first slice holds it.
        """
        n = len(ends)
        vals = list(map(self.first.get, ends, repeat(_UNKNOWN, n)))
        n = _index(vals, None, n)
        held = _index(vals, _UNKNOWN, n)  # ends[:held]: the first slice holds them
        settled = held == n
        if not settled:
            self._ask_first.append(_unknown(ends, vals, held, n))
        if self._others and held:
            rest = list(map(self.others.get, ends[:held], repeat(_UNKNOWN, held)))
            held = _index(rest, False, held)
            n = min(n, held)
            u = _index(rest, _UNKNOWN, held)
            if u < held:
                settled = False
                self._ask_others.append(_unknown(ends, rest, u, held))
        return n, settled

    def _first_stored(self, cands: list[int]) -> tuple[int | None, bool]:
        """The first of ``cands`` every slice holds (None: none), and whether that is settled."""
        settled = True
        for j in cands:
            v = self.first.get(j, _UNKNOWN)
            if v is None:
                continue
            if v is _UNKNOWN:
                self._ask_first.append([j])
                if self.calls and self._others:
                    # past the first level, a tail's slices are asked together: a run that broke in the
                    # middle costs no third call
                    self._ask_others.append([j])
                settled = False
                continue
            if self._others:
                w = self.others.get(j, _UNKNOWN)
                if w is False:
                    continue
                if w is _UNKNOWN:
                    self._ask_others.append([j])
                    settled = False
                    continue
            return (j, True) if settled else (None, False)
        return None, settled


@dataclass(frozen=True)
class LoadPlan:
    """The stored chunks a load of a request reads, in order, with what the probe that found them learned.

    ``chunks[i]`` = ``(first, last)`` blocks (chunks start on multiples of ``chunk_blocks``; the first one
    holds block ``local``, the probe's first); ``hashes[i]`` is vLLM's hash of block ``last`` (it names the
    chunk's objects); ``tiers[i]`` the tier holding the chunk's object in the last slice written when the
    probe looked (statistics: the load does not depend on it); ``keys[s][i]`` the key of the chunk's object
    in slice ``s`` (None: not planned, the loader derives it from the hash; a recurrent-state slice's key is
    planned for the last chunk alone).  ``state``: the reach ends on a recurrent state.  Never changed once
    made: :meth:`before` makes a shorter one.  A probe's plan is what its lease holds (leases.py).
    """

    local: int
    salt: str | None
    chunk_blocks: int
    chunks: list[Chunk]
    hashes: list[bytes]
    tiers: list[str | None]
    keys: list[list[str | None]]
    state: bool = False

    def lease_keys(self) -> list[str]:
        """Every planned key (what a lease for the load holds)."""
        flat = list(chain.from_iterable(self.keys))
        return [k for k in flat if k is not None] if None in flat else flat  # type: ignore[return-value]

    def cut_at(self, gone: Sequence[str]) -> int | None:
        """Blocks of the reach from ``local`` that precede the first chunk with a key in ``gone`` (keys the
        store no longer holds); None when no key of ``gone`` is planned.  A reach ending on a recurrent state
        is cut to 0 (no state is known at an earlier boundary)."""
        lost = set(gone)
        first = min((i for col in self.keys for i, k in enumerate(col) if k in lost), default=None)
        if first is None:
            return None
        return 0 if self.state else max(0, self.chunks[first][0] - self.local)

    def before(self, reach: int) -> LoadPlan:
        """The plan of the chunks wholly inside the first ``reach`` blocks from ``local`` (a chunk ending past
        them is dropped, whatever it started on)."""
        top = self.local + reach
        n = 0 if reach <= 0 else sum(1 for _, last in self.chunks if last < top)
        return LoadPlan(self.local, self.salt, self.chunk_blocks, self.chunks[:n], self.hashes[:n], self.tiers[:n],
                        [col[:n] for col in self.keys], self.state)


def cut_answer(answer: ProbeAnswer, reach: int, reason: str) -> ProbeAnswer:
    """``answer`` with its reach ended after ``reach`` blocks, the blocks cut counted as missed for ``reason``."""
    if reach >= answer.reach:
        return answer
    missed = dict(answer.missed)
    missed[reason] = missed.get(reason, 0) + answer.reach - reach
    return ProbeAnswer(reach, answer.held, answer.where[:reach], answer.leased, missed)


class Prober:
    """Answers a worker's questions about its store, each in one pass.

    ``store()`` is the store to ask (looked up per question, so a caller may wrap
    it); ``locality`` the declared locality of each tier by name.
    """

    def __init__(self, keys: LayerKeys, chunk_blocks: int, store: Callable[[], TieredStore | None],
                 locality: dict[str, str | None], state_slices: Sequence[int] = ()) -> None:
        self._keys = keys
        self._chunk_blocks = chunk_blocks
        self._store = store
        self._locality = locality
        self._places: dict[str, TierPlace] = {}
        #: slices of recurrent-state groups: one object per block boundary whose state was saved, asked
        #: about apart (a prefix of them is not a run of stored chunks)
        self._state_slices = list(state_slices)
        if self._state_slices and chunk_blocks != 1:
            raise ValueError("recurrent-state slices need one block per object (chunk_blocks 1)")
        skip = set(self._state_slices)
        prefix = [i for i in range(keys.num_slices) if i not in skip]
        # the last of them is written last (saves follow the forward's layer order): asked first
        self._all_slices = [prefix[-1], *prefix[:-1]]
        self._last_slice = [prefix[-1]]

    def _run(self, p: _Pass, windows: list[tuple[int, int]]) -> list[list[Chunk]]:
        while True:
            got = [p.window(lo, hi) for lo, hi in windows]
            if all(c is not None for c in got):
                return got  # type: ignore[return-value]  # (none is None)
            if not p.fetch():
                raise RuntimeError("a probe pass asked for nothing yet is not settled")

    def probe(self, request: ProbeRequest) -> ProbeAnswer:
        """The scheduler's question about one request (service.py), answered in one pass."""
        return self.probe_plan(request, plan=False)[0]

    def probe_plan(self, request: ProbeRequest, count_misses: bool = True,
                   plan: bool = True) -> tuple[ProbeAnswer, LoadPlan | None]:
        """:meth:`probe`, and (with ``plan``) the :class:`LoadPlan` of its reach: the chunks it counts on,
        with every slice's key and the tier each was found in, from the same pass (what a lease for the
        request's load holds, and what that load reads).

        The blocks past the reach are explained (``ProbeAnswer.missed``) from the chunks the pass found
        absent, by one ``why_missing`` call (counted in the store's ``misses_by_reason`` with
        ``count_misses``); a probe that reaches the end asks nothing more."""
        store = self._store()
        if store is None:
            raise RuntimeError("the connector's worker is shut down")
        hashes, lo = request.hashes, request.local
        hi = len(hashes)
        p = _Pass(self._keys, store, hashes, 0, request.salt, self._all_slices, self._chunk_blocks)
        windows = [(lo, hi)] + ([(0, lo)] if lo else [])
        found = self._run(p, windows)
        reach = covered(found[0], lo, hi)
        held = covered(found[1], 0, lo) if lo else 0
        state_keys: list[str] = []
        cut = 0  # blocks of the prefix's reach past the last boundary whose state is stored
        if self._state_slices and reach:
            reach, state_keys = self._state_reach(store, hashes, lo, reach, request.salt)
            cut = covered(found[0], lo, hi) - reach
            found[0] = [c for c in found[0] if c[1] < lo + reach]
        where: list[TierPlace | None] = []
        tiers = p.first
        chunks = found[0] if reach else []
        for first, last in chunks:
            n = min(last + 1, hi) - max(first, lo)
            where += [self._place(tiers.get(last))] * n
        missed = self._explain(p, store, lo + reach + cut, hi, count_misses) if lo + reach + cut < hi else {}
        if cut:  # stored in every attention slice, but no state saved at a boundary past the hit
            word = MissReason.NEVER_STORED.value
            missed[word] = missed.get(word, 0) + cut
            if count_misses:
                store.count_misses(MissReason.NEVER_STORED, cut)
        answer = ProbeAnswer(reach, held, where, missed=missed)
        return answer, (self._plan(p, request, chunks, state_keys) if plan else None)

    def _plan(self, p: _Pass, request: ProbeRequest, chunks: list[Chunk], state_keys: list[str]) -> LoadPlan:
        """The plan of ``chunks`` (found by ``p``), its keys those ``p`` asked about (no key hashed twice)."""
        ends = [last for _, last in chunks]
        n = len(ends)
        cols: list[list[str | None] | None] = [None] * self._keys.num_slices
        borrowed: set[int] = set()  # (columns that are a batch's own list: copied before a write)
        at: dict[int, int] | None = None
        for s, asked, got in p.asked if n else ():
            if cols[s] is None and asked == ends:  # (the usual batch: the chunks found, in order)
                cols[s] = got  # type: ignore[assignment]
                borrowed.add(s)
                continue
            if at is None:
                at = {e: i for i, e in enumerate(ends)}
            col = cols[s]
            if col is None:
                col = cols[s] = [None] * n
            elif s in borrowed:
                col = cols[s] = list(col)
                borrowed.discard(s)
            for e, k in zip(asked, got):
                i = at.get(e)
                if i is not None:
                    col[i] = k
        if state_keys:
            for s, k in zip(self._state_slices, state_keys):
                cols[s] = [None] * (n - 1) + [k]
        none: list[str | None] = [None] * n
        keys: list[list[str | None]] = [none if c is None else c for c in cols]
        return LoadPlan(request.local, request.salt, self._chunk_blocks, list(chunks),
                        [request.hashes[e] for e in ends], [p.first.get(e) for e in ends], keys,
                        bool(self._state_slices))

    def _state_reach(self, store: TieredStore, hashes: Sequence[bytes], lo: int, reach: int,
                     salt: str | None) -> tuple[int, list[str]]:
        """The longest reach ``<= reach`` from ``lo`` whose last boundary's state every state slice holds, and
        those objects' keys: one ``locate`` of every state slice's object of every block in the reach."""
        hs = [hashes[b] for b in range(lo, lo + reach)]
        keys = [self._keys.keys(s, hs, salt) for s in self._state_slices]
        tiers = store.locate([k for ks in keys for k in ks])
        n = len(hs)
        for j in range(n - 1, -1, -1):
            if all(tiers[i * n + j] is not None for i in range(len(keys))):
                return j + 1, [ks[j] for ks in keys]
        return 0, []

    def _explain(self, p: _Pass, store: TieredStore, b0: int, hi: int, count: bool) -> dict[str, int]:
        """Blocks ``b0 .. hi-1`` (not served) by reason: the blocks of each absent chunk take its reason, and
        the blocks between absent chunks (stored, but past the break) the reason of the absent chunk before
        them; with no absent chunk asked about, ``never_stored``.

        One namespace check, for the absent chunk that breaks the prefix alone: a request with a cache salt
        whose break the store never saw is ``other_namespace`` when the store holds that chunk unsalted (one
        more key and one more ``locate``).  Other namespaces (model, layout, KV-head shard) are not asked."""
        first = p.first
        ends = list(compress(first, map(not_, first.values())))  # (absent from the first slice asked; in C)
        ends += [e for e, ok in p.others.items() if not ok and first.get(e)]  # (rare: another slice lacks it)
        ends.sort()
        ends = ends[bisect_left(ends, b0):]
        if not ends:
            return {str(MissReason.NEVER_STORED): hi - b0}
        reasons = store.why_missing(list(map(p.first_keys.__getitem__, ends)), count=False)
        if reasons[0] is MissReason.NEVER_STORED and p._salt is not None and self._unsalted(p, store, ends[0]):
            reasons[0] = MissReason.OTHER_NAMESPACE
        if count:
            for r, n in Counter(reasons).items():
                store.count_misses(r, n)
        if reasons.count(reasons[0]) == len(reasons):  # one reason for all (the common case)
            return {reasons[0].value: hi - b0}
        out: dict[str, int] = {}
        at, before = b0, reasons[0].value
        # runs of absent chunks with one reason: the blocks from a run's first chunk to its last take its reason
        # (the stored ones between them too: the absent chunk before them has that reason)
        for reason, run in groupby(zip(ends, reasons), key=itemgetter(1)):
            got = list(run)
            last = got[-1][0]
            if last < at:
                continue  # (tails inside a chunk counted already)
            word = reason.value
            start = max(at, got[0][0] - p.chunk_blocks + 1)
            if start > at:  # stored blocks past the break: the reason of the absent chunk before them
                out[before] = out.get(before, 0) + start - at
            end = min(last, hi - 1)
            out[word] = out.get(word, 0) + end - start + 1
            at, before = end + 1, word
            if at >= hi:
                break
        if at < hi:
            out[before] = out.get(before, 0) + hi - at
        return out

    def _unsalted(self, p: _Pass, store: TieredStore, end: int) -> bool:
        """Whether the store holds the last slice's object of the chunk ending at ``end`` without a salt."""
        key = self._keys.keys(self._last_slice[0], [p._hashes[end - p._base]], None)
        return store.locate(key)[0] is not None

    def locate(self, hashes: Sequence[bytes], base: int, lo: int, hi: int, salt: str | None) -> LoadPlan:
        """The plan of a load of blocks ``lo .. hi-1`` that no probe planned (``hashes[i]`` names block
        ``base+i``): the stored chunks by the last slice written alone (one batched ``locate``), each with its
        key in that slice and the tier holding it; the other slices' keys are left to the loader.  A rank the
        scheduler does not ask (a replica of a KV-head shard), or a lookup that leased nothing, loads so."""
        store = self._store()
        if store is None:
            raise RuntimeError("the connector's worker is shut down")
        p = _Pass(self._keys, store, hashes, base, salt, self._last_slice, self._chunk_blocks)
        (found,) = self._run(p, [(lo, hi)])
        ends = [last for _, last in found]
        n = len(ends)
        none: list[str | None] = [None] * n
        keys = [none] * self._keys.num_slices
        keys[self._last_slice[0]] = [p.first_keys[e] for e in ends]
        return LoadPlan(lo, salt, self._chunk_blocks, found, [hashes[e - base] for e in ends],
                        [p.first.get(e) for e in ends], keys)

    def _place(self, tier: str | None) -> TierPlace | None:
        if tier is None:
            return None
        place = self._places.get(tier)
        if place is None:
            place = self._places[tier] = TierPlace(tier, self._locality.get(tier))
        return place
