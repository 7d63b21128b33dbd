"""``LevelIndex``: the packed index of one managed level, and the typed questions it answers.

The index holds one ``int`` per chunk: READY > 0, RESERVED < 0, and an ``Entry``
only for a doomed chunk a reader still holds; pins are counts in ``pinned``
(``entry`` gives a view of any state).  For a *located* tier (the slab under
``hbm`` and ``dram``) the int is the tier's location code, taken at ``reserve``
and given back when the chunk is freed, and the tier keeps nothing per object;
for any other tier it is one shared value per size.  ``used`` is the sum of the
footprints of the entries, ``ready_count`` / ``ready_bytes`` those of the READY ones.

The encoding is private to this module and to ``Level`` (``tierkv/engine/level.py``),
which builds on ``LevelIndex`` and makes every change of state (reserve, commit,
pin, drop, evict).  Everyone else asks typed, batched questions (``holds``,
``ready_sizes``, ``probe_sized``, ``footprints``...), and an eviction policy that
follows the level's order sees it through ``LevelOrder`` (``policies/eviction.py``),
where a token is opaque but for "READY is a positive int".  Every question is asked
under the store's lock.
"""

from __future__ import annotations

from operator import neg as _neg
from typing import Any, Optional, Union

from tierkv.tiers.base import CODE_SHIFT, NB_FIELD, Tier


class Entry:
    """A view of one object of a managed level (``Level.entry``); in the index, a doomed chunk still read.

    The index holds one packed ``int`` per chunk (a shared object for each distinct
    size): positive while READY, negative while RESERVED.  An ``Entry`` stands in the
    index only for a chunk that was dropped while a reader holds it (``doomed``),
    until the last ``unpin`` frees it.
    """

    __slots__ = ("code", "doomed", "footprint", "nbytes", "pins", "ready")

    def __init__(self, nbytes: int, footprint: int, ready: bool = False, code: int = 0) -> None:
        self.nbytes = nbytes
        self.footprint = footprint
        self.ready = ready
        self.pins = 0
        self.doomed = False
        self.code = code  # a located tier's code, to give back at the last unpin


# An index int (READY; its negation while RESERVED) is ``X << CODE_SHIFT | f << 1 | 1``
# (never 0): ``f`` is nbytes below ``NB_FIELD``; at ``NB_FIELD`` the level asks
# ``value_nbytes``.  For a located tier X is the tier's; otherwise X is 0, or
# nbytes itself for a large chunk, and the value is shared by every chunk of one size.
_NB_MASK = NB_FIELD
#: distinct sizes whose values are shared; past it, each entry keeps its own
_CANON_LIMIT = 4096

Slot = Union[int, Entry]
_INT = {int}
_ONE = {1}
_STR = {str}


def size_value(nbytes: int) -> int:
    """The READY value of a chunk of ``nbytes`` in a level whose tier is not located."""
    return nbytes << 1 | 1 if nbytes < NB_FIELD else nbytes << CODE_SHIFT | NB_FIELD << 1 | 1


class _Order:
    """A level's ``LevelOrder`` (``policies/eviction.py``): its entries, and what a policy may ask of them."""

    __slots__ = ("entries", "footprint", "ready_bytes", "ready_count")

    def __init__(self, level: LevelIndex) -> None:
        self.entries = level._index
        self.footprint = level._value_footprint
        self.ready_count = level.entries
        self.ready_bytes = lambda: level.ready_bytes


class LevelIndex:
    """The index of one level over ``tier``: its entries, pins, and bytes; ``located``: the int is the tier's code."""

    def __init__(self, tier: Tier, located: bool) -> None:
        self.tier = tier
        self.name = tier.name
        #: the tier leaves each object's location to this level (its code is the index int)
        self.located = located
        #: key -> int (> 0 READY, < 0 RESERVED) or, for a doomed chunk still read, an ``Entry``
        self._index: dict[str, Slot] = {}
        #: key -> number of readers holding it (the keys eviction must not name)
        self.pinned: dict[str, int] = {}
        self.used = 0
        self.ready_count = 0
        self.ready_bytes = 0  # footprint of the READY entries
        self._canon: dict[int, int] = {}
        #: nbytes -> (footprint, shared reservation value): a medium's footprint is a function of nbytes alone
        self._fps: dict[int, tuple[int, int]] = {}
        self._fp_only: dict[int, int] = {}  # nbytes -> footprint (the same sizes as ``_fps``)

    def level_order(self) -> _Order:
        """This index as a ``LevelOrder``, for an eviction policy that follows it."""
        return _Order(self)

    def entries(self) -> int:
        """How many READY objects the level holds."""
        return self.ready_count

    # -- the index -----------------------------------------------------------------
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

    def ready_codes(self, keys: list[str]) -> list[Optional[int]]:
        """A located tier's code of each READY key (None for any other); what ``tier.read`` by key uses."""
        return [v if type(v) is int and v > 0 else None for v in map(self._index.get, keys)]

    def codes(self, keys: list[str]) -> list[int]:
        """The located tier's code of each key, which the caller holds (pinned, or reserved by it)."""
        vals: list[Any] = list(map(self._index.__getitem__, keys))
        if vals and set(map(type, vals)) == _INT:  # the common cases in C loops: all READY, or all RESERVED
            if min(vals) > 0:
                return vals
            if max(vals) < 0:
                return list(map(_neg, vals))
        out = []
        for key in keys:
            v = self._index[key]
            out.append((v if v > 0 else -v) if type(v) is int else v.code)  # type: ignore[union-attr,operator]
        return out

    def holds(self, key: str) -> bool:
        """Whether ``key`` is READY here."""
        v = self._index.get(key)
        return type(v) is int and v > 0

    def ready_nbytes(self, key: str) -> int:
        """nbytes of ``key`` if it is READY here, else -1."""
        v = self._index.get(key)
        if type(v) is int and v > 0:
            return self._value_nbytes(v)
        return -1

    def entry(self, key: str) -> Optional[Entry]:
        """A view of ``key``'s state (nbytes, footprint, ready, pins, doomed); None if absent."""
        v = self._index.get(key)
        if v is None:
            return None
        if type(v) is int:
            nb, fp = self._unpack(v)
            e = Entry(nb, fp, ready=v > 0)
        else:
            e = Entry(v.nbytes, v.footprint)  # type: ignore[union-attr]
            e.doomed = True
        e.pins = self.pinned.get(key, 0)
        return e

    def items(self) -> list[tuple[str, Entry]]:
        """(key, ``entry(key)``) for every key in the index, in the level's order."""
        return [(k, self.entry(k)) for k in list(self._index)]  # type: ignore[misc]

    def keys(self) -> list[str]:
        """Every key in the index (RESERVED, READY or doomed), in the level's order."""
        return list(self._index)

    def ready_keys(self) -> list[str]:
        """The READY keys, in the level's order."""
        return [k for k, v in self._index.items() if type(v) is int and v > 0]

    # -- typed questions, batched (C-level loops in the common case) ----------------
    def knows(self, key: str) -> bool:
        """Whether ``key`` is in the index in any state (READY, RESERVED, or doomed and still read)."""
        return key in self._index

    def lacking(self, keys: list[str]) -> list[str]:
        """The keys of ``keys`` that are not READY here, in order."""
        get = self._index.get
        return [k for k in keys if not (type(v := get(k)) is int and v > 0)]  # type: ignore[operator]

    def knows_none(self, keys: Any) -> bool:
        """Whether none of ``keys`` is in the index, in any state."""
        return self._index.keys().isdisjoint(keys)

    def busy(self, key: str) -> bool:
        """Whether ``key`` is READY or RESERVED (being written) here; a doomed one is neither."""
        return type(self._index.get(key)) is int

    def reserved(self, key: str) -> bool:
        """Whether ``key`` is RESERVED (being written) here."""
        v = self._index.get(key)
        return type(v) is int and v < 0

    def not_dropped(self, key: str) -> bool:
        """Whether a key the caller holds pinned is still READY (not dropped, doomed, meanwhile)."""
        return type(self._index.get(key)) is int

    def none_dropped(self, keys: list[str]) -> bool:
        """``not_dropped`` of every key."""
        return set(map(type, map(self._index.get, keys))) == _INT

    def all_ready(self, keys: list[str]) -> bool:
        """Whether every key (at least one) is READY here."""
        vals: list[Any] = list(map(self._index.get, keys))
        try:
            return bool(vals) and min(vals) > 0
        except TypeError:  # (a miss, or a doomed chunk)
            return False

    def leading_ready(self, keys: list[str]) -> int:
        """How many leading keys are READY here."""
        if self.all_ready(keys):
            return len(keys)
        n = 0
        for v in map(self._index.get, keys):
            if type(v) is not int or v < 0:
                break
            n += 1
        return n

    def ready_sizes(self, keys: list[str]) -> list[int]:
        """nbytes of each key READY here, -1 for any other."""
        vals: list[Any] = list(map(self._index.get, keys))
        if vals and set(map(type, vals)) == _INT and min(vals) > 0:
            fields = [v >> 1 & _NB_MASK for v in vals]
            if _NB_MASK not in fields:  # (at the marker: a large chunk, sized elsewhere)
                return fields
        return [self._value_nbytes(v) if type(v) is int and v > 0 else -1 for v in vals]

    def probe_sized(self, keys: list[str], sizes: list[int]) -> Optional[list[int]]:
        """When every key (at least one) is READY here with exactly its size in ``sizes``, their codes (what
        ``read_at`` of a located tier takes; meaningless for any other); else None (ask ``ready_sizes``)."""
        vals: list[Any] = list(map(self._index.get, keys))
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
        v = self._index[key]
        return self._value_nbytes(v) if type(v) is int else v.nbytes  # type: ignore[union-attr,arg-type]

    # -- what an eviction may take (``tierkv.engine.victims`` checks a policy's answer with these) -----------
    def evictable_footprint(self, keys: list) -> Optional[int]:
        """The footprint bytes of ``keys`` when they pass every check at once (distinct READY keys of
        this level, none pinned, sizes remembered); None to check them one by one."""
        if not keys or set(map(type, keys)) != _STR or len(set(keys)) != len(keys):
            return None
        vals: list[Any] = list(map(self._index.get, keys))
        if set(map(type, vals)) != _INT or min(vals) < 0 or not self.pinned.keys().isdisjoint(keys):
            return None
        fields = [v >> 1 & _NB_MASK for v in vals]
        if _NB_MASK in fields:  # a large chunk's size lives elsewhere: the per-key path
            return None
        fps: list[Any] = list(map(self._fp_only.get, fields))
        return None if None in fps else sum(fps)

    def ready_footprint(self, key: Any) -> int:
        """The footprint of ``key`` if it is READY here (pinned or not), else -1 (also for a key not a str)."""
        v = self._index.get(key) if isinstance(key, str) else None
        if type(v) is not int or v < 0:  # type: ignore[operator]
            return -1
        f = v >> 1 & NB_FIELD  # type: ignore[operator]
        fp = self._fp_only.get(f) if f != NB_FIELD else None  # (at the marker the size is elsewhere)
        return fp if fp is not None else self._unpack(v)[1]  # type: ignore[arg-type]
