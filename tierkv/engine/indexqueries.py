"""The read-only side of a level's index: the encoding's helpers and the typed, batched questions.

Ownership: ``IndexQueries`` is the base of ``LevelIndex`` (``tierkv/engine/levelindex.py``), which owns
the state these methods read (the slots, the pins, the counts) and every change to it; nothing here
changes a slot, a pin or a count.  The one thing written here is the per-size memo (footprint and
shared value of each size, bounded by ``_CANON_LIMIT``), which never changes an answer.  This module
also holds the pieces of the encoding both sides use (see ``levelindex``'s docstring for the layout):
``Entry`` (a doomed chunk's slot, and the view ``entry`` answers), ``Slot`` and ``size_value``.

Every question is batched where the callers ask in batches and takes C-level loops in the common
case, with a per-key path that means the same.  Every call is made under the store's lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import reduce
from itertools import repeat
from operator import gt as _gt
from operator import length_hint as _length_hint
from operator import neg as _neg
from operator import or_ as _or
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Optional, Union

from tierkv.location_code import CODE_SHIFT, NB_FIELD  # (the code layout, shared with located media)

if TYPE_CHECKING:
    from tierkv.tenants import TenantLedger
    from tierkv.tiers.base import Tier

_NB_MASK = NB_FIELD
#: distinct sizes whose values are shared; past it, each entry keeps its own
_CANON_LIMIT = 4096
_INT = {int}
_STR = {str}
_ZERO = repeat(0)  # (an endless argument column of zeros: ``map`` stops at its shortest argument)

#: each question's fast path, on (True) or off: the per-key path then answers alone.  ``leading``:
#: ``leading_ready`` and ``ready_flags`` (the lookup's probes) in C loops that stop at the first miss
#: (``tests/test_lookup_fast.py`` asks random key lists both ways and compares the answers)
FAST: dict[str, bool] = {"leading": True}


def leading_in_any(indexes: Sequence[IndexQueries], keys: list[str]) -> int:
    """How many leading keys of ``keys`` are READY in at least one of ``indexes`` (the managed levels of a
    chain, asked from the first key the top one lacks); a ``TypeError`` for an unhashable key met on the way.

    The fast path (``FAST["leading"]``) asks every index at once, key by key in C loops (each index's
    ``ready_flags`` over its own iterator of ``keys``, joined with ``or``), and stops at the first key
    none holds; the per-key path below means the same.
    """
    if FAST["leading"] and indexes:
        its = [iter(keys) for _ in indexes]
        held = reduce(lambda a, b: map(_or, a, b), [ix.ready_flags(it) for ix, it in zip(indexes, its)])
        try:
            if all(held):
                return len(keys)
            return len(keys) - _length_hint(its[0]) - 1  # (every iterator took as many keys: the first miss too)
        except TypeError:  # a doomed chunk (or an unhashable key: the path below raises it)
            pass
    n = 0
    for key in keys:
        if not any(ix.holds(key) for ix in indexes):
            break
        n += 1
    return n


class Entry:
    """A view of one object of a managed level (``LevelIndex.entry``); in the index, a doomed chunk still read.

    An ``Entry`` stands in the index only for a chunk that was dropped while a reader holds it
    (``doomed``), until the last ``unpin`` frees it; ``code`` is a located tier's code to give back then.
    """

    __slots__ = ("code", "doomed", "footprint", "nbytes", "pins", "ready")

    def __init__(self, nbytes: int, footprint: int, ready: bool = False, code: int = 0) -> None:
        self.nbytes = nbytes
        self.footprint = footprint
        self.ready = ready
        self.pins = 0
        self.doomed = False
        self.code = code


Slot = Union[int, Entry]


def size_value(nbytes: int) -> int:
    """The READY value of a chunk of ``nbytes`` in a level whose tier is not located."""
    return nbytes << 1 | 1 if nbytes < NB_FIELD else nbytes << CODE_SHIFT | NB_FIELD << 1 | 1


class IndexQueries:
    """The questions a level's index answers (see the module docstring); ``LevelIndex`` holds the state."""

    # (the state, set and changed by ``LevelIndex`` alone; declared here for the questions that read it)
    tier: Tier
    name: str
    located: bool
    _slots: dict[str, Slot]
    _pins: dict[str, int]
    used: int
    ready_count: int
    ready_bytes: int
    _canon: dict[int, int]
    _fps: dict[int, tuple[int, int]]
    _fp_only: dict[int, int]
    ledger: Optional[TenantLedger]

    @property
    def pinned(self) -> MappingProxyType:
        """key -> readers holding it, read-only."""
        return MappingProxyType(self._pins)

    def entries(self) -> int:
        """How many READY objects the level holds."""
        return self.ready_count

    # -- sizes and values ----------------------------------------------------------
    def _shared(self, v: int) -> int:
        """The one int object for the value ``v`` (bounded: past the limit, ``v`` itself)."""
        got = self._canon.get(v)
        if got is not None:
            return got
        if len(self._canon) < _CANON_LIMIT:
            self._canon[v] = v
        return v

    def _size(self, nbytes: int) -> tuple[int, int]:
        """(footprint, shared reservation value) of a chunk of ``nbytes``."""
        c = self._fps.get(nbytes)
        if c is None:
            fp = self.tier.footprint(nbytes)
            c = (fp, self._shared(-size_value(nbytes)))
            if len(self._fps) < _CANON_LIMIT:
                self._fps[nbytes] = c
                self._fp_only[nbytes] = fp
        return c

    def footprint(self, nbytes: int) -> int:
        """The tier's footprint of a chunk of ``nbytes`` (remembered per size)."""
        fp = self._fp_only.get(nbytes)
        return fp if fp is not None else self._size(nbytes)[0]

    def _value_nbytes(self, v: int) -> int:
        """nbytes of an index int (READY, or RESERVED: negative)."""
        if v < 0:
            v = -v
        f = v >> 1 & NB_FIELD
        if f != NB_FIELD:
            return f
        return self.tier.code_nbytes(v) if self.located else v >> CODE_SHIFT

    def _value_footprint(self, v: int) -> int:
        """The footprint of an index int that is READY (its size looked up once per size)."""
        f = v >> 1 & NB_FIELD
        fp = self._fp_only.get(f) if f != NB_FIELD else None  # (at the marker the size is elsewhere)
        return fp if fp is not None else self._unpack(v)[1]

    def _unpack(self, v: int) -> tuple[int, int]:
        """(nbytes, footprint) of an index int (READY or RESERVED)."""
        nb = self._value_nbytes(v)
        return nb, self._size(nb)[0]

    # -- typed questions, batched (C-level loops in the common case) ----------------
    def ready_codes(self, keys: list[str]) -> list[Optional[int]]:
        """A located tier's code of each READY key (None for any other); what ``tier.read`` by key uses."""
        return [v if type(v) is int and v > 0 else None for v in map(self._slots.get, keys)]

    def codes(self, keys: list[str]) -> list[int]:
        """The located tier's code of each key, which the caller holds (pinned, or reserved by it)."""
        vals: list[Any] = list(map(self._slots.__getitem__, keys))
        if vals and set(map(type, vals)) == _INT:  # the common cases in C loops: all READY, or all RESERVED
            if min(vals) > 0:
                return vals
            if max(vals) < 0:
                return list(map(_neg, vals))
        out = []
        for key in keys:
            v = self._slots[key]
            out.append((v if v > 0 else -v) if type(v) is int else v.code)  # type: ignore[union-attr,operator]
        return out

    def holds(self, key: str) -> bool:
        """Whether ``key`` is READY here."""
        v = self._slots.get(key)
        return type(v) is int and v > 0

    def ready_nbytes(self, key: str) -> int:
        """nbytes of ``key`` if it is READY here, else -1."""
        v = self._slots.get(key)
        if type(v) is int and v > 0:
            return self._value_nbytes(v)
        return -1

    def entry(self, key: str) -> Optional[Entry]:
        """A view of ``key``'s state (nbytes, footprint, ready, pins, doomed); None if absent."""
        v = self._slots.get(key)
        if v is None:
            return None
        if type(v) is int:
            nb, fp = self._unpack(v)
            e = Entry(nb, fp, ready=v > 0)
        else:
            e = Entry(v.nbytes, v.footprint)  # type: ignore[union-attr]
            e.doomed = True
        e.pins = self._pins.get(key, 0)
        return e

    def items(self) -> list[tuple[str, Entry]]:
        """(key, ``entry(key)``) for every key in the index, in the level's order."""
        return [(k, self.entry(k)) for k in list(self._slots)]  # type: ignore[misc]

    def keys(self) -> list[str]:
        """Every key in the index (RESERVED, READY or doomed), in the level's order."""
        return list(self._slots)

    def ready_keys(self) -> list[str]:
        """The READY keys, in the level's order."""
        return [k for k, v in self._slots.items() if type(v) is int and v > 0]

    def knows(self, key: str) -> bool:
        """Whether ``key`` is in the index in any state (READY, RESERVED, or doomed and still read)."""
        return key in self._slots

    def lacking(self, keys: list[str]) -> list[str]:
        """The keys of ``keys`` that are not READY here, in order."""
        get = self._slots.get
        return [k for k in keys if not (type(v := get(k)) is int and v > 0)]  # type: ignore[operator]

    def knows_none(self, keys: Any) -> bool:
        """Whether none of ``keys`` is in the index, in any state."""
        return self._slots.keys().isdisjoint(keys)

    def busy(self, key: str) -> bool:
        """Whether ``key`` is READY or RESERVED (being written) here; a doomed one is neither."""
        return type(self._slots.get(key)) is int

    def reserved(self, key: str) -> bool:
        """Whether ``key`` is RESERVED (being written) here."""
        v = self._slots.get(key)
        return type(v) is int and v < 0

    def not_dropped(self, key: str) -> bool:
        """Whether a key the caller holds pinned is still READY (not dropped, doomed, meanwhile)."""
        return type(self._slots.get(key)) is int

    def none_dropped(self, keys: list[str]) -> bool:
        """``not_dropped`` of every key."""
        return set(map(type, map(self._slots.get, keys))) == _INT

    def all_ready(self, keys: list[str]) -> bool:
        """Whether every key (at least one) is READY here."""
        vals: list[Any] = list(map(self._slots.get, keys))
        try:
            return bool(vals) and min(vals) > 0
        except TypeError:  # (a miss, or a doomed chunk)
            return False

    def leading_ready(self, keys: list[str]) -> int:
        """How many leading keys are READY here (a ``TypeError`` for an unhashable key met on the way).

        The fast path (``FAST["leading"]``, a list of keys) walks the keys in one C loop that stops at the
        first key not READY: the position comes from what is left of the list's iterator.
        """
        if FAST["leading"] and type(keys) is list:
            it = iter(keys)
            try:
                if all(self.ready_flags(it)):
                    return len(keys)
                return len(keys) - _length_hint(it) - 1  # (``all`` took the first key not READY, too)
            except TypeError:  # a doomed chunk (or an unhashable key: the path below raises it)
                pass
        if self.all_ready(keys):
            return len(keys)
        n = 0
        for v in map(self._slots.get, keys):
            if type(v) is not int or v < 0:
                break
            n += 1
        return n

    def ready_flags(self, keys: Iterator[str]) -> Iterator[bool]:
        """Lazily, whether each key of ``keys`` is READY here, in C loops; taking a flag takes its key.

        Taking a flag raises a ``TypeError`` for an unhashable key, and for a key whose chunk is doomed (an
        ``Entry``, neither READY nor an int): the caller then asks key by key (``holds``).  With every slot
        READY (no write in flight, no doomed chunk) a key's presence is its readiness, and its value is not
        read: at a million chunks each value is an int object of its own, a cache miss apiece.
        """
        slots = self._slots
        if self.ready_count == len(slots):
            return map(slots.__contains__, keys)
        vals: Iterator[Any] = map(slots.get, keys, _ZERO)  # (absent: 0; RESERVED < 0; doomed: an Entry)
        return map(_gt, vals, _ZERO)  # (an Entry: TypeError)

    def ready_sizes(self, keys: list[str]) -> list[int]:
        """nbytes of each key READY here, -1 for any other."""
        vals: list[Any] = list(map(self._slots.get, keys))
        if vals and set(map(type, vals)) == _INT and min(vals) > 0:
            fields = [v >> 1 & _NB_MASK for v in vals]
            if _NB_MASK not in fields:  # (at the marker: a large chunk, sized elsewhere)
                return fields
        return [self._value_nbytes(v) if type(v) is int and v > 0 else -1 for v in vals]

    def probe_sized(self, keys: list[str], sizes: list[int]) -> Optional[list[int]]:
        """When every key (at least one) is READY here with exactly its size in ``sizes``, their codes (what
        ``read_at`` of a located tier takes; meaningless for any other); else None (ask ``ready_sizes``)."""
        vals: list[Any] = list(map(self._slots.get, keys))
        if (vals and set(map(type, vals)) == _INT and min(vals) > 0
                and (fields := [v >> 1 & _NB_MASK for v in vals]) == sizes
                and _NB_MASK not in fields):  # (a field at the marker: a large chunk, sized elsewhere)
            return vals
        return None

    def footprints(self, sizes: list[int]) -> int:
        """The sum of the footprints of chunks of these sizes (each size looked up once)."""
        fps: list[Any] = list(map(self._fp_only.get, sizes))
        return sum(fps) if None not in fps else sum([self.footprint(nb) for nb in sizes])

    def nbytes_of(self, key: str) -> int:
        """nbytes of ``key``, in any state (it must be in the index)."""
        v = self._slots[key]
        return self._value_nbytes(v) if type(v) is int else v.nbytes  # type: ignore[union-attr,arg-type]

    def evictable_footprint(self, keys: list) -> Optional[int]:
        """The footprint bytes of ``keys`` when they pass every check at once (distinct READY keys of
        this level, none pinned, sizes remembered); None to check them one by one."""
        if not keys or set(map(type, keys)) != _STR or len(set(keys)) != len(keys):
            return None
        vals: list[Any] = list(map(self._slots.get, keys))
        if set(map(type, vals)) != _INT or min(vals) < 0 or not self._pins.keys().isdisjoint(keys):
            return None
        fields = [v >> 1 & _NB_MASK for v in vals]
        if _NB_MASK in fields:  # a large chunk's size lives elsewhere: the per-key path
            return None
        fps: list[Any] = list(map(self._fp_only.get, fields))
        return None if None in fps else sum(fps)

    def ready_footprint(self, key: Any) -> int:
        """The footprint of ``key`` if it is READY here (pinned or not), else -1 (also for a key not a str)."""
        v = self._slots.get(key) if isinstance(key, str) else None
        if type(v) is not int or v < 0:  # type: ignore[operator]
            return -1
        f = v >> 1 & NB_FIELD  # type: ignore[operator]
        fp = self._fp_only.get(f) if f != NB_FIELD else None  # (at the marker the size is elsewhere)
        return fp if fp is not None else self._unpack(v)[1]  # type: ignore[arg-type]

    def ready_footprints(self, keys: list) -> Optional[list[int]]:
        """The footprint of each key when every one (at least one) is READY here, else None."""
        vals: list[Any] = list(map(self._slots.get, keys))
        if not vals or set(map(type, vals)) != _INT or min(vals) < 0:
            return None
        fields = [v >> 1 & _NB_MASK for v in vals]
        fps: list[Any] = list(map(self._fp_only.get, fields)) if _NB_MASK not in fields else [None]
        return fps if None not in fps else [self._value_footprint(v) for v in vals]
