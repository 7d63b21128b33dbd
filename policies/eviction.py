"""Eviction policies: which chunks a full tier gives up, in which order.

A policy keeps its own metadata (never the tier's container) and is told about
every change through three hooks; ``victims`` names keys to evict.  The store
calls the hooks under its lock, so a policy needs no locking of its own.

Contract of ``victims(nbytes, protected)``:
    Return keys currently tracked by the policy, in eviction order, whose sizes
    add up to at least ``nbytes``, none of them in ``protected`` (chunks pinned by
    a read or a write in flight; a read-only container: a policy that tries to
    change it gets an error).  Return ``None`` when that is impossible.  The
    store checks the answer (unknown, duplicate or protected keys raise
    ``PolicyError``) and then calls ``on_remove`` for each victim it evicts: a
    policy must not forget a key just because it named it.

Batch hooks: ``on_insert_many(keys, sizes)``, ``on_access_many(keys)`` and
``on_remove_many(keys)`` mean the same as the single hooks called for each key in
order; ``on_adopt(keys, sizes)`` (chunks a persistent tier recovered, at a store's
open) means ``on_insert_many``.  The base class implements them that way, so a subclass that implements only
the four single hooks works unchanged; the built-ins override them with tighter
loops, and a store may prefer them when it has a batch in hand.

Memory: sizes are held as shared ``int`` objects (``_Sizes``), so a tracked key costs
its container entries only; LRU and FIFO keep one plain dict (insertion order is
their eviction order); LFU keeps one insertion-ordered dict per frequency instead of
a sorted list of tuples; S3-FIFO's queues and ARC's T1 and T2 are plain dicts too.

The level order (one rule, the same for built-in and user policies): a policy whose class
has ``follows_level_order = True`` is handed, before first use, a view of its level's order
(``LevelOrder``, through ``follow_order``: an iterator of the READY entries and
``move_to_end``, never the level's mapping) instead of keeping an order of its own.  The
attribute is an ordinary class attribute: a subclass inherits its parent's mode and keeps it
when it overrides a hook.  The built-ins say True: LRU and FIFO then order the level's
entries themselves, and S3-FIFO, LFU and ARC take its READY entries as their queue of keys
not read since they entered (small, frequency 1, T1), keeping only read keys and ghosts
themselves.  A subclass that wants its own metadata (reads ``_od``, ``_small``, ``_t1``...)
says ``follows_level_order = False`` in its body.  A policy given no order (outside a store,
or a level whose policy already tracks keys) keeps its own, with the same answers
(``tests/test_policy_differential.py``).

Reporting: ``memory_bytes()`` is what the policy's own containers hold (keys shared with the
level not counted), ``counters()`` its figures by name (queue lengths and bytes, ghosts); the
store's ``stats()`` shows both per tier, under ``eviction_policy``.

Subclass ``EvictionPolicy`` and implement the four hooks to customise eviction.
"""

from __future__ import annotations

import sys
from collections.abc import Container, Hashable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Optional, Protocol

Key = Hashable


class _Sizes:
    """Canonical ``int`` objects for chunk sizes: chunks of one model share a few sizes, and
    a size held by a container then costs nothing per key.  Bounded: past ``limit``
    distinct sizes, new ones are kept as given."""

    __slots__ = ("_d", "_limit")

    def __init__(self, limit: int = 4096) -> None:
        self._d: dict[int, int] = {}
        self._limit = limit

    def __call__(self, n: int) -> int:
        got = self._d.get(n)
        if got is not None:
            return got
        if len(self._d) < self._limit:
            self._d[n] = n
        return n

    def many(self, ns: list[int]) -> list[int]:
        """``self(n)`` of each (one C loop when every size is known)."""
        got = list(map(self._d.get, ns))
        return got if None not in got else [self(n) for n in ns]  # type: ignore[return-value]


class LevelOrder(Protocol):
    """The order of a level's entries, as a level offers it to a policy that follows it (a view).

    A key enters the order at its end when room is reserved for it.  Iterating yields
    ``(key, footprint)`` of each READY entry (readable, known to the policy), oldest first;
    reservations and chunks on their way out are never yielded.  ``move_to_end(keys)`` is the
    one change a policy may make (keys absent are skipped), and only once a walk is over; the
    order never changes while the policy is not being called.  ``footprint(key)`` is a READY
    key's footprint (-1 for any other key), ``footprints(keys)`` each one's when all are READY
    (else None); ``ready_count()`` and ``ready_bytes()`` count the READY entries; ``settled()``
    says no reservation or departing chunk is in the order.
    """

    def __iter__(self) -> Iterator[tuple[str, int]]: ...

    def footprint(self, key: Key) -> int: ...

    def footprints(self, keys: list) -> Optional[list[int]]: ...

    def move_to_end(self, keys: Sequence[Key]) -> None: ...

    def ready_count(self) -> int: ...

    def ready_bytes(self) -> int: ...

    def settled(self) -> bool: ...


class EvictionPolicy:
    """Base class: implement ``on_insert``, ``on_access``, ``on_remove``, ``victims``."""

    #: config name (``"eviction": "lru"``)
    name = "custom"
    #: this class orders its level's entries (``follow_order``) instead of keeping an order of its
    #: own; inherited like any class attribute: a subclass that wants its own metadata says False
    follows_level_order = False

    def follow_order(self, order: LevelOrder) -> None:
        """Take ``order`` (its level's) instead of an order of its own; called once, before first use, on a
        policy whose class says ``follows_level_order``."""
        raise NotImplementedError(f"{type(self).__name__} says follows_level_order but has no follow_order")

    def __init__(self) -> None:
        #: capacity of the tier this policy serves; set by the store before first use
        self.capacity_bytes: Optional[int] = None

    def on_insert(self, key: Key, nbytes: int) -> None:
        """A chunk of ``nbytes`` became readable in the tier."""
        raise NotImplementedError

    def on_access(self, key: Key) -> None:
        """A chunk was read from the tier."""
        raise NotImplementedError

    def on_remove(self, key: Key) -> None:
        """A chunk left the tier (evicted, removed or found corrupt)."""
        raise NotImplementedError

    def victims(self, nbytes: int, protected: Container[Key]) -> Optional[list[Key]]:
        """Keys to evict, in order, freeing ≥ ``nbytes`` without touching ``protected``; None if impossible."""
        raise NotImplementedError

    # -- batch hooks: the single hooks for each key, in order (override for speed)
    def on_insert_many(self, keys: Sequence[Key], sizes: Sequence[int]) -> None:
        """``on_insert(keys[i], sizes[i])`` for each i, in order."""
        for key, nbytes in zip(keys, sizes):
            self.on_insert(key, nbytes)

    def on_adopt(self, keys: Sequence[Key], sizes: Sequence[int]) -> None:
        """Chunks a persistent tier kept from an earlier process became readable, oldest first (a store's
        open: millions at once).  Means ``on_insert_many(keys, sizes)``, which it calls; override it to
        load the metadata in bulk (a policy sharing a level's index has nothing to do)."""
        self.on_insert_many(keys, sizes)

    def on_access_many(self, keys: Iterable[Key]) -> None:
        """``on_access(key)`` for each key, in order."""
        for key in keys:
            self.on_access(key)

    def on_remove_many(self, keys: Iterable[Key]) -> None:
        """``on_remove(key)`` for each key, in order."""
        for key in keys:
            self.on_remove(key)

    def __len__(self) -> int:  # optional: how many chunks the policy tracks
        return 0

    def memory_bytes(self) -> int:
        """Bytes the policy's own metadata holds (its containers; keys shared with the level not counted).
        The base answers 0: a policy with metadata of its own overrides it."""
        return 0

    def counters(self) -> dict[str, int]:
        """The policy's figures by name (queue lengths, bytes, ghosts...); the base answers ``tracked``."""
        return {"tracked": len(self)}


def _gather(pairs: Iterable[tuple[Key, int]], protected: Container[Key], nbytes: int, out: list[Key],
            freed: int = 0) -> int:
    """Append to ``out`` the unprotected keys of ``pairs`` ((key, size), in eviction order) until ``freed``
    reaches ``nbytes``; returns the bytes freed so far (``>= nbytes``: enough)."""
    for key, n in pairs:
        if key in protected:
            continue
        out.append(key)
        freed += n
        if freed >= nbytes:
            break
    return freed


def _take(pairs: Iterable[tuple[Key, int]], nbytes: int, protected: Container[Key]) -> Optional[list[Key]]:
    """The unprotected keys of ``pairs``, in order, that cover ``nbytes``; None when they cannot."""
    out: list[Key] = []
    if nbytes <= 0:
        return out
    return out if _gather(pairs, protected, nbytes, out) >= nbytes else None


class LRUPolicy(EvictionPolicy):
    """Least recently used first.

    One plain dict, key -> size, in recency order (oldest first): a read pops the
    key and puts it back at the end.  A dict entry costs about half of an
    ``OrderedDict``'s (no linked-list node per key).

    In a store it follows its level's order (``follow_order``): it then keeps no dict
    of its own and orders the level's entries itself (``move_to_end``), so a chunk costs
    one dict entry for both.  A chunk's place in that order is its reservation (the
    level enters it when it reserves room), then its last read; ``on_insert`` and
    ``on_remove`` are then nothing to do.  A subclass follows too; one that reads ``_od``
    (an ordered mapping: ``iter``, ``reversed``, ``[key]``) says
    ``follows_level_order = False``.
    """

    name = "lru"
    follows_level_order = True

    def __init__(self) -> None:
        super().__init__()
        self._od: dict[Key, int] = {}
        self._size = _Sizes()
        #: the level's order, when this policy follows it (then ``_od`` stays empty)
        self._order: Optional[LevelOrder] = None

    def follow_order(self, order: LevelOrder) -> None:
        """Order the level's entries instead of a dict of its own."""
        if self._od:
            raise RuntimeError(f"{type(self).__name__} already tracks keys: follow an order before first use")
        self._order = order

    def on_insert(self, key, nbytes):
        if self._order is not None:
            return
        od = self._od
        od.pop(key, None)
        od[key] = self._size(nbytes)

    def on_access(self, key):
        if self._order is not None:
            self._order.move_to_end((key,))
            return
        od = self._od
        n = od.pop(key, None)
        if n is not None:
            od[key] = n

    def on_remove(self, key):
        if self._order is None:
            self._od.pop(key, None)

    def on_insert_many(self, keys, sizes):
        if self._order is not None:
            return
        od, size, pop, known = self._od, self._size, self._od.pop, self._size._d.get
        if type(keys) is list and od.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            # all new (the common case): appended in order by C loops
            shared = list(map(known, sizes))
            if None in shared:
                shared = [size(n) for n in sizes]
            od.update(zip(keys, shared))
            return
        for key, nbytes in zip(keys, sizes):
            if key in od:
                pop(key)
            n = known(nbytes)
            od[key] = size(nbytes) if n is None else n

    def on_access_many(self, keys):
        if self._order is not None:
            self._order.move_to_end(keys if type(keys) is list else list(keys))
            return
        od, pop = self._od, self._od.pop
        if type(keys) is list and len(set(keys)) == len(keys):
            # distinct keys: take out the present ones, put them back at the end in order (C loops)
            got = list(map(pop, keys, repeat(None)))
            od.update(zip(keys, got) if None not in got else [(k, n) for k, n in zip(keys, got) if n is not None])
            return
        for key in keys:
            n = pop(key, None)
            if n is not None:
                od[key] = n

    def on_remove_many(self, keys):
        if self._order is not None:
            return
        pop = self._od.pop
        for key in keys:
            pop(key, None)

    def victims(self, nbytes, protected):
        # (following the level: its READY entries only)
        return _take(self._od.items() if self._order is None else self._order, nbytes, protected)

    def __len__(self):
        return self._order.ready_count() if self._order is not None else len(self._od)

    def memory_bytes(self) -> int:
        return sys.getsizeof(self._od) + sys.getsizeof(self._size._d)

    def counters(self) -> dict[str, int]:
        return {"tracked": len(self), "own_entries": len(self._od),
                "follows_level_order": int(self._order is not None)}


class FIFOPolicy(LRUPolicy):
    """First in, first out: reads do not refresh a chunk."""

    name = "fifo"
    follows_level_order = True

    def on_access(self, key):
        pass

    def on_access_many(self, keys):
        pass


class LFUPolicy(EvictionPolicy):
    """Least frequently used first; ties go to the oldest access.

    One insertion-ordered bucket (key -> size) per frequency: a key enters the end
    of a bucket each time its frequency changes, so within a bucket keys run from
    the oldest such change to the newest, and walking the buckets by rising
    frequency is the eviction order.  Every hook is O(1); ``victims`` sorts the
    frequencies present (few) and walks from the front.

    In a store it follows its level's order (``follow_order``): frequency 1 (never
    read since it entered) is then the level's READY entries not read, in the level's
    order, so only read keys cost the policy a bucket entry and a frequency.  A subclass
    follows too unless it says ``follows_level_order = False``.
    """

    name = "lfu"
    follows_level_order = True

    def __init__(self) -> None:
        super().__init__()
        self._freq: dict[Key, int] = {}
        self._buckets: dict[int, dict[Key, int]] = {}  # plain dicts: insertion order is the order needed
        self._size = _Sizes()
        #: the level's order, when this policy follows it: frequency 1 is its READY entries not in ``_freq``
        self._order: Optional[LevelOrder] = None

    def follow_order(self, order: LevelOrder) -> None:
        """Take the level's READY entries not read as frequency 1."""
        if len(self):
            raise RuntimeError(f"{type(self).__name__} already tracks keys: follow an order before first use")
        self._order = order

    def _enter(self, key, freq, nbytes):
        bucket = self._buckets.get(freq)
        if bucket is None:
            bucket = self._buckets[freq] = {}
        bucket[key] = nbytes
        self._freq[key] = freq

    def _leave(self, key, freq):
        bucket = self._buckets[freq]
        nbytes = bucket.pop(key)
        if not bucket:
            del self._buckets[freq]
        return nbytes

    def on_insert(self, key, nbytes):
        freq = self._freq.get(key)
        if freq is not None:
            self._leave(key, freq)
        if self._order is None:
            self._enter(key, 1, self._size(nbytes))
        elif freq is not None:
            del self._freq[key]

    def on_access(self, key):
        freq = self._freq.get(key)
        if freq is not None:
            self._enter(key, freq + 1, self._leave(key, freq))
        elif self._order is not None:
            fp = self._order.footprint(key)
            if fp >= 0:  # READY: from frequency 1 (the level's order) to 2
                self._enter(key, 2, self._size(fp))

    def on_remove(self, key):
        freq = self._freq.pop(key, None)
        if freq is not None:
            self._leave(key, freq)

    def on_insert_many(self, keys, sizes):
        get = self._freq.get
        if self._order is not None:
            if self._freq and not self._freq.keys().isdisjoint(keys):
                for key in keys:
                    if get(key) is not None:
                        self.on_insert(key, 0)
            return
        enter, leave, size = self._enter, self._leave, self._size
        if type(keys) is list and self._freq.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            # all new (the common case): appended to frequency 1 in order by C loops
            known = size._d.get
            shared = list(map(known, sizes))
            if None in shared:
                shared = [size(n) for n in sizes]
            bucket = self._buckets.get(1)
            if bucket is None:
                bucket = self._buckets[1] = {}
            bucket.update(zip(keys, shared))
            self._freq.update(dict.fromkeys(keys, 1))
            return
        for key, nbytes in zip(keys, sizes):
            freq = get(key)
            if freq is not None:
                leave(key, freq)
            enter(key, 1, size(nbytes))

    def on_access_many(self, keys):
        order = self._order
        if order is not None:
            freq = self._freq
            if type(keys) is list and freq.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
                fps = order.footprints(keys)
                if fps is not None:
                    # first reads of distinct READY keys (the common case): to frequency 2 by C loops
                    bucket = self._buckets.get(2)
                    if bucket is None:
                        bucket = self._buckets[2] = {}
                    bucket.update(zip(keys, self._size.many(fps)))
                    freq.update(dict.fromkeys(keys, 2))
                    return
            for key in keys:
                self.on_access(key)
            return
        get, enter, leave = self._freq.get, self._enter, self._leave
        for key in keys:
            freq = get(key)
            if freq is not None:
                enter(key, freq + 1, leave(key, freq))

    def on_remove_many(self, keys):
        freq = self._freq
        if not freq:
            return
        pop, leave = freq.pop, self._leave
        for key in keys:
            f = pop(key, None)
            if f is not None:
                leave(key, f)

    def victims(self, nbytes, protected):
        out, freed = [], 0
        if nbytes <= 0:
            return out
        order = self._order
        if order is not None:
            # frequency 1 first: the level's READY entries not read.  The read ones gather at the order's
            # front; those met go behind the rest once the walk is over, so the next walk does not meet them
            moved: list[Key] = []
            others = self._freq
            try:
                for key, n in order:
                    if key in others:
                        moved.append(key)
                        continue
                    if key in protected:
                        continue
                    out.append(key)
                    freed += n
                    if freed >= nbytes:
                        return out
            finally:
                order.move_to_end(moved)
        for freq in sorted(self._buckets):
            freed = _gather(self._buckets[freq].items(), protected, nbytes, out, freed)
            if freed >= nbytes:
                return out
        return None

    def __len__(self):
        return self._order.ready_count() if self._order is not None else len(self._freq)

    def memory_bytes(self) -> int:
        return (sys.getsizeof(self._freq) + sys.getsizeof(self._buckets) + sys.getsizeof(self._size._d)
                + sum(sys.getsizeof(b) for b in self._buckets.values()))

    def counters(self) -> dict[str, int]:
        return {"tracked": len(self), "read_keys": len(self._freq), "frequencies": len(self._buckets),
                "follows_level_order": int(self._order is not None)}


def _trim_front(d: dict, total: int, limit: float) -> int:
    """Drop the oldest entries of ``d`` (key -> size, ``total`` bytes) while it holds more than ``limit``;
    the bytes left.  One walk from the front for all of them: a plain dict's front is found by
    passing the entries deleted since its last resize, so trimming one key at a time would pass
    them once per key."""
    if total <= limit or not d:
        return total
    drop = []
    for key, n in d.items():
        if total <= limit:
            break
        total -= n
        drop.append(key)
    for key in drop:
        del d[key]
    return total
