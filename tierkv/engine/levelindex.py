"""``LevelIndex``: the packed index of one managed level, the only keeper of its encoding.

Ownership: a ``Level`` (``tierkv/engine/level.py``) builds one ``LevelIndex`` and holds it as
``level.index``; nothing else writes to it.  The index owns the per-chunk state of its level
(the slots, the pins, the byte counts, the tenant charges) and changes it only through its
batched mutators: ``reserve``, ``commit``, ``abort``, ``pin``, ``unpin``, ``drop``, ``evict``
(and ``adopt``, ``reserve`` and ``commit`` at once for the chunks a persistent medium
recovered at a store's open).  A mutator never calls the medium: what it frees comes back as
a ``Freed`` (keys, and a located tier's codes), which the level gives back to its tier.
Everyone else asks typed, batched questions (``holds``, ``ready_sizes``, ``probe_sized``...),
and an eviction policy that follows the level's order sees it through an ``OrderView`` (an
iterator of READY entries and ``move_to_end``), never the mapping.  Every call is made under
the store's lock.

The encoding: one ``int`` per chunk, READY > 0, RESERVED < 0 (the negation), and an ``Entry``
only for a chunk dropped while a reader holds it (*doomed*).  A READY int is
``X << CODE_SHIFT | f << 1 | 1`` (never 0), ``f`` the nbytes below ``NB_FIELD`` and
``NB_FIELD`` at or past it.  For a *located* tier (the slab under ``hbm`` and ``dram``) the
int is the tier's location code, built by the tier from the constants here, taken at
``reserve`` and given back when the chunk is freed; for any other tier ``X`` is 0 (or nbytes
for a large chunk) and the value is one shared object per size.

Invariants (``check`` verifies each of them):

* ``used`` is the sum of the footprints of every slot (READY, RESERVED and doomed) and never
  exceeds the tier's capacity; ``ready_count`` / ``ready_bytes`` count the READY slots;
* a pinned key is READY or doomed, with a count of at least 1; a doomed slot is pinned (the
  last ``unpin`` frees it); a pinned key is never offered for eviction;
* a RESERVED or READY slot of a located tier holds a code no other slot holds; of any other
  tier, the shared value of its size;
* with a tenant ledger, the ledger's usage adds up to ``used``;
* the order a policy follows yields exactly the READY slots, ``ready_count`` of them.

Fast paths: each batched mutator has a C-loop path for the common case and a per-key path
that means the same; ``FAST`` switches each one off (``tests/test_store_invariants.py`` runs
one random workload both ways and compares every state and answer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from operator import neg as _neg
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Union

from tierkv.errors import PolicyError
from tierkv.location_code import CODE_SHIFT, NB_FIELD  # (the code layout, shared with located media)

if TYPE_CHECKING:
    from tierkv.tenants import TenantLedger
    from tierkv.tiers.base import Tier

#: each batched mutator's fast path, on (True) or off: the per-key path then does every step
FAST: dict[str, bool] = {"reserve": True, "commit": True, "pin": True, "unpin": True, "evict": True}

_NB_MASK = NB_FIELD
#: distinct sizes whose values are shared; past it, each entry keeps its own
_CANON_LIMIT = 4096
_INT = {int}
_ONE = {1}
_STR = {str}


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


class Freed(NamedTuple):
    """What a mutator freed, for the level to give back to its tier: the keys, and a located tier's codes."""

    keys: list[str]
    codes: list[int]


class IndexInvariantError(AssertionError):
    """An invariant of a level's index does not hold (``LevelIndex.check``)."""


def size_value(nbytes: int) -> int:
    """The READY value of a chunk of ``nbytes`` in a level whose tier is not located."""
    return nbytes << 1 | 1 if nbytes < NB_FIELD else nbytes << CODE_SHIFT | NB_FIELD << 1 | 1


class OrderView:
    """The level's order as an eviction policy that follows it sees it (``policies/eviction.py``, ``LevelOrder``).

    Iterating yields ``(key, footprint)`` of each READY entry, oldest first (a key enters the
    order when room is reserved for it); ``move_to_end`` is the one change a policy may make.
    The order never changes while the policy is not being called, and a policy changes it
    only after a walk is over.
    """

    __slots__ = ("_index", "_slots")

    def __init__(self, index: LevelIndex) -> None:
        self._index = index
        self._slots = index._slots

    def __iter__(self) -> Iterator[tuple[str, int]]:
        fp = self._index._value_footprint
        for key, v in self._slots.items():
            if type(v) is int and v > 0:  # READY (not reserved, not doomed)
                yield key, fp(v)

    def footprint(self, key: Any) -> int:
        """The footprint of ``key`` if it is READY, else -1."""
        return self._index.ready_footprint(key)

    def footprints(self, keys: list) -> Optional[list[int]]:
        """The footprint of each key when every one is READY, else None (C loops in the common case)."""
        return self._index.ready_footprints(keys)

    def move_to_end(self, keys: Sequence[Any]) -> None:
        """Put each key present (in any state) at the end of the order, in the order given."""
        slots = self._slots
        pop = slots.pop
        if type(keys) is list and len(set(keys)) == len(keys):
            got: list[Any] = list(map(pop, keys, repeat(None)))
            slots.update(zip(keys, got) if None not in got else [(k, v) for k, v in zip(keys, got) if v is not None])
            return
        for key in keys:
            v = pop(key, None)
            if v is not None:
                slots[key] = v

    def ready_count(self) -> int:
        """How many READY entries the order holds."""
        return self._index.ready_count

    def ready_bytes(self) -> int:
        """The sum of the READY entries' footprints."""
        return self._index.ready_bytes

    def settled(self) -> bool:
        """Whether every entry is READY (no reservation out, no doomed chunk still read)."""
        return len(self._slots) == self._index.ready_count


class LevelIndex:
    """The index of one level over ``tier`` (see the module docstring); ``located``: the int is the tier's code."""

    def __init__(self, tier: Tier, located: bool) -> None:
        self.tier = tier
        self.name = tier.name
        #: the tier leaves each object's location to this level (its code is the index int)
        self.located = located
        #: key -> int (> 0 READY, < 0 RESERVED) or, for a doomed chunk still read, an ``Entry``
        self._slots: dict[str, Slot] = {}
        #: key -> number of readers holding it (the keys eviction must not name)
        self._pins: dict[str, int] = {}
        #: footprint bytes of every slot; of the READY ones, and how many (read them, never assign)
        self.used = 0
        self.ready_count = 0
        self.ready_bytes = 0
        self._canon: dict[int, int] = {}
        #: nbytes -> (footprint, shared reservation value): a medium's footprint is a function of nbytes alone
        self._fps: dict[int, tuple[int, int]] = {}
        self._fp_only: dict[int, int] = {}  # nbytes -> footprint (the same sizes as ``_fps``)
        #: per-tenant usage (None: no tenant configured), and the tenant of a key being reserved
        self.ledger: Optional[TenantLedger] = None
        self._label_of: Callable[[str], str] = str

    def set_quotas(self, ledger: TenantLedger, label_of: Callable[[str], str]) -> None:
        """Charge every reservation to ``label_of(key)`` in ``ledger`` and credit every freed slot (the index
        is empty)."""
        if self._slots:
            raise RuntimeError(f"tier {self.name!r}: quotas are set on an empty level")
        self.ledger = ledger
        self._label_of = label_of

    @property
    def pinned(self) -> MappingProxyType:
        """key -> readers holding it, read-only."""
        return MappingProxyType(self._pins)

    def order(self) -> OrderView:
        """The view of this index an eviction policy that follows the level's order is given."""
        return OrderView(self)

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
        """How many leading keys are READY here."""
        if self.all_ready(keys):
            return len(keys)
        n = 0
        for v in map(self._slots.get, keys):
            if type(v) is not int or v < 0:
                break
            n += 1
        return n

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

    # -- the mutators ----------------------------------------------------------------
    def reserve(self, keys: list[str], sizes: list[int],
                allocate: Optional[Callable[[list[int]], list[Optional[int]]]] = None) -> list[int]:
        """Reserve room for each (key, nbytes) in order, without evicting; one code each: 0 reserved now,
        1 already READY or reserved here, 2 not reserved (no room, over the tenant's cap, a doomed copy
        still read, or the tier could not place it).

        A located tier's level passes ``allocate`` (its tier's codes for some sizes, None where one was
        not placed; never raising): the codes are taken here.  A reservation is charged to its tenant.
        """
        slots, cap, size = self._slots, self.tier.capacity_bytes, self._size
        fps = self._fps
        used = self.used
        ledger = self.ledger
        pre: Optional[list[Optional[int]]] = None  # the codes the fast path was given for the whole batch
        if (FAST["reserve"] and ledger is None and type(keys) is list and len(keys) > 1
                and slots.keys().isdisjoint(keys) and len(set(keys)) == len(keys)):
            # all new, all distinct (the common case): if the whole batch fits, reserve it in C loops
            fps_all = list(map(self._fp_only.get, sizes))
            if None not in fps_all:
                total = sum(fps_all)  # type: ignore[arg-type]
                if used + total <= cap:
                    if not self.located:
                        slots.update(zip(keys, [fps[nb][1] for nb in sizes]))
                        self.used = used + total
                        return [0] * len(keys)
                    pre = allocate(sizes)  # type: ignore[misc]
                    if None not in pre:
                        slots.update(zip(keys, map(_neg, pre)))  # type: ignore[arg-type]
                        self.used = used + total
                        return [0] * len(keys)
        out: list[int] = []
        append = out.append
        fresh: list[int] = []  # positions reserved now (located: to be given their codes)
        try:
            for key, nbytes in zip(keys, sizes):
                c = fps.get(nbytes)
                if c is None:
                    c = size(nbytes)
                fp = c[0]
                if key in slots:
                    append(1 if type(slots[key]) is int else 2)
                    continue
                if used + fp > cap:
                    append(2)
                    continue
                if ledger is not None:
                    label = self._label_of(key)
                    if ledger.over_cap(label, fp):  # (room must come from the tenant's own chunks: evict first)
                        append(2)
                        continue
                    ledger.charge(key, label, fp)
                slots[key] = c[1]
                used += fp
                fresh.append(len(out))
                append(0)
        finally:
            self.used = used
        if self.located and fresh:
            # (``pre``: the fast path's codes, for exactly these positions: all of the batch)
            codes = pre if pre is not None else allocate([sizes[i] for i in fresh])  # type: ignore[misc]
            slots.update([(keys[i], -c) for i, c in zip(fresh, codes) if c is not None])
            if None in codes:
                for i, c in zip(fresh, codes):
                    if c is None:  # the tier could not place it: the reservation goes
                        del slots[keys[i]]
                        fp = size(sizes[i])[0]
                        self.used -= fp
                        if ledger is not None:
                            ledger.credit(keys[i], fp)
                        out[i] = 2
        return out

    def commit(self, keys: list[str]) -> list[int]:
        """Make these reservations READY; their footprints, in order (``PolicyError`` if one is no reservation,
        before anything changes)."""
        slots = self._slots
        held: list[Any] = list(map(slots.get, keys))
        if not FAST["commit"] or not held or set(map(type, held)) != _INT or max(held) >= 0:
            for key, v in zip(keys, held):
                if type(v) is not int or v > 0:
                    raise PolicyError(f"tier {self.name!r}: no reservation for {key[:80]!r}")
        if not FAST["commit"]:
            out = []
            for key, v in zip(keys, held):
                fp = self._size(self._value_nbytes(v))[0]
                slots[key] = -v if self.located else self._shared(-v)
                self.ready_count += 1
                self.ready_bytes += fp
                out.append(fp)
            return out
        ready = list(map(_neg, held))
        nbs = [v >> 1 & _NB_MASK for v in ready]
        if _NB_MASK in nbs:
            nbs = [self._value_nbytes(v) for v in ready]
        got = list(map(self._fps.get, nbs))
        if None in got:
            got = [self._size(nb) for nb in nbs]
        if not self.located:
            ready = list(map(self._shared, ready))
        slots.update(zip(keys, ready))
        sizes = [c[0] for c in got]  # type: ignore[index]
        self.ready_count += len(keys)
        self.ready_bytes += sum(sizes)
        return sizes

    def adopt(self, keys: list[str], sizes: Any, tell: Callable[[Any], None]) -> bool:
        """Enter chunks a persistent medium recovered as READY, oldest first, in bulk (a store's open), into an
        empty index of a tier that is not located; ``tell(footprints)`` is then called once (the level tells
        its policy), and if it raises none of the chunks stays.

        ``sizes``: their nbytes, an int array.  The caller chose them: keys that fit in the room left.  The
        index is loaded by C-level operations (one footprint and one shared value per distinct size, spread
        by numpy).  Returns False, changing nothing, when some key is listed twice.
        """
        import numpy as np

        n = len(keys)
        slots = self._slots
        if self.located or slots:
            raise RuntimeError(f"tier {self.name!r}: adopt loads an empty index of a tier that is not located")
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if sizes.min() == sizes.max():  # one size (the common case): no sort
            fp, v = self._size(int(sizes[0]))[0], self._shared(size_value(int(sizes[0])))
            fps = np.full(n, fp, dtype=np.int64)
            total = fp * n
            vals: Any = None
        else:
            uniq, inv = np.unique(sizes, return_inverse=True)
            inv = inv.reshape(-1)
            fps_u = np.empty(len(uniq), dtype=np.int64)
            vals_u = np.empty(len(uniq), dtype=object)
            for i, nb in enumerate(uniq.tolist()):  # one step per distinct size, never per chunk
                fps_u[i] = self._size(nb)[0]
                vals_u[i] = self._shared(size_value(nb))
            fps = fps_u[inv]
            total = int(fps.sum())
            vals = vals_u[inv].tolist()  # (the shared value objects, spread in C)
        if self.used + total > self.tier.capacity_bytes:
            raise ValueError(f"tier {self.name!r}: {n} recovered chunks ({total} bytes) exceed the room left")
        slots.update(zip(keys, repeat(v) if vals is None else vals))
        if len(slots) != n:  # some key listed twice (the index was empty)
            slots.clear()
            return False
        self.used += total
        self.ready_count += n
        self.ready_bytes += total
        ledger = self.ledger
        if ledger is not None:  # (a recovered chunk's tenant is not known: it counts as OTHER's)
            from tierkv.tenants import OTHER

            ledger.usage[OTHER] += total
        try:
            tell(fps)
        except BaseException:
            slots.clear()  # (it held these alone) none of them may stay unknown to the policy
            if ledger is not None:
                ledger.usage[OTHER] -= total
            self.used -= total
            self.ready_count -= n
            self.ready_bytes -= total
            raise
        return True

    def abort(self, keys: list[str]) -> Freed:
        """Release the RESERVED keys among ``keys`` (a write that failed, never ran, or must not stay)."""
        slots, freed = self._slots, Freed([], [])
        for key in keys:
            v = slots.get(key)
            if type(v) is int and v < 0:  # type: ignore[operator]
                fp = self._unpack(v)[1]  # type: ignore[arg-type]
                del slots[key]
                self.used -= fp
                if self.ledger is not None:
                    self.ledger.credit(key, fp)
                freed.keys.append(key)
                if self.located:
                    freed.codes.append(-v)  # type: ignore[operator]
        return freed

    def pin(self, keys: list[str]) -> None:
        """Hold each READY key for a reader (once per time it is named): never named as a victim nor freed
        until ``unpin``.  ``KeyError`` if one is not READY, before any is pinned."""
        pins, slots = self._pins, self._slots
        vals = list(map(slots.get, keys))
        if not FAST["pin"] or set(map(type, vals)) != _INT or min(vals) < 0:  # type: ignore[type-var,operator]
            for key, v in zip(keys, vals):
                if type(v) is not int or v < 0:  # type: ignore[operator]
                    raise KeyError(f"tier {self.name!r}: {key[:80]!r} is not READY")
        if FAST["pin"] and not pins and len(set(keys)) == len(keys):
            pins.update(dict.fromkeys(keys, 1))
            return
        get = pins.get
        for key in keys:
            pins[key] = get(key, 0) + 1

    def unpin(self, keys: list[str]) -> Freed:
        """Release one pin of each key; the last one frees a chunk dropped meanwhile (doomed).  ``KeyError``
        for a key not pinned (the keys before it are released)."""
        pins, slots, freed = self._pins, self._slots, Freed([], [])
        if (FAST["unpin"] and len(pins) == len(keys) and set(map(pins.get, keys)) == _ONE
                and set(map(type, map(slots.get, keys))) == _INT):
            pins.clear()  # exactly these keys, each pinned once, none doomed: nothing to free
            return freed
        for key in keys:
            n = pins[key] - 1
            if n:
                pins[key] = n
                continue
            del pins[key]
            v = slots.get(key)
            if type(v) is Entry:  # dropped while read
                self._free(key, v.footprint, v.code, freed)
        return freed

    def drop(self, keys: list[str]) -> tuple[list[str], Freed]:
        """Make each key unreadable now; its slot is freed now, or when the last reader lets go (doomed).
        A doomed or absent key is left as it is.  Returns the keys that were READY (their policy is to
        be told) and what was freed."""
        slots, freed, was_ready = self._slots, Freed([], []), []
        for key in keys:
            v = slots.get(key)
            if type(v) is not int:
                continue  # absent, or already doomed
            if v > 0:  # type: ignore[operator]
                was_ready.append(key)
            self._discard(key, v, freed)  # type: ignore[arg-type]
        return was_ready, freed

    def _discard(self, key: str, v: int, freed: Freed) -> None:
        """Unmark ``key`` (int ``v`` in the index): free it now, or doom it while a reader holds it."""
        nb, fp = self._unpack(v)
        if v > 0:
            self.ready_count -= 1
            self.ready_bytes -= fp
        code = (v if v > 0 else -v) if self.located else 0
        if key in self._pins:
            e = self._slots[key] = Entry(nb, fp, code=code)
            e.doomed = True
        else:
            self._free(key, fp, code, freed)

    def _free(self, key: str, footprint: int, code: int, freed: Freed) -> None:
        del self._slots[key]
        self.used -= footprint
        if self.ledger is not None:
            self.ledger.credit(key, footprint)
        freed.keys.append(key)
        if self.located:
            freed.codes.append(code)

    def evict(self, keys: list[str], gone: list[str], freed: Freed) -> None:
        """``drop`` each key, then release the one pin the caller (an eviction) holds on it: a key no other
        reader holds is freed now.  Appends to ``gone`` the READY keys that left (their policy is to be told)
        and to ``freed`` what was freed, also when a fault part way (a key not pinned: ``KeyError``) raises;
        the caller's pins on the keys after it are still released."""
        slots, pins = self._slots, self._pins
        vals: list[Any] = list(map(slots.get, keys))
        if (FAST["evict"] and vals and set(map(type, vals)) == _INT and min(vals) > 0
                and set(map(pins.get, keys)) == _ONE and len(set(keys)) == len(keys)):
            # the common case: distinct READY keys, each held by this eviction alone: all leave at once
            fields = [v >> 1 & _NB_MASK for v in vals]
            # (a field at the marker is a large chunk's: its size lives elsewhere)
            fps: list[Any] = list(map(self._fp_only.get, fields)) if _NB_MASK not in fields else [None]
            if None in fps:
                fps = [self._value_footprint(v) for v in vals]
            for key in keys:
                del pins[key]
                del slots[key]
            total = sum(fps)
            if self.ledger is not None:
                for key, fp in zip(keys, fps):
                    self.ledger.credit(key, fp)
            self.ready_count -= len(keys)
            self.ready_bytes -= total
            self.used -= total
            gone += keys
            freed.keys.extend(keys)
            if self.located:
                freed.codes.extend(vals)
            return
        done = 0
        try:
            for key in keys:
                done += 1
                v = slots.get(key)
                if type(v) is not int or v < 0 or pins.get(key) != 1:  # doomed, or read by others too
                    if type(v) is int and v > 0:
                        gone.append(key)
                        self._discard(key, v, freed)
                    self._unpin_one(key, freed)
                    continue
                del pins[key]
                self.ready_count -= 1
                fp = self._value_footprint(v)
                self.ready_bytes -= fp
                gone.append(key)
                self._free(key, fp, v, freed)
        finally:
            for key in keys[done:]:  # a fault part way: the caller's pins on the rest are still released
                if key in pins:
                    self._unpin_one(key, freed)

    def _unpin_one(self, key: str, freed: Freed) -> None:
        n = self._pins[key] - 1
        if n:
            self._pins[key] = n
            return
        del self._pins[key]
        v = self._slots.get(key)
        if type(v) is Entry:
            self._free(key, v.footprint, v.code, freed)

    # -- invariants ------------------------------------------------------------------
    def check(self) -> None:
        """Verify every invariant of the module docstring; ``IndexInvariantError`` (an ``AssertionError``) naming each
        one that does not hold.  Walks the whole index: for tests and diagnostics, not the hot path."""
        bad: list[str] = []
        used = ready_bytes = ready_count = 0
        codes: dict[int, str] = {}
        for key, v in self._slots.items():
            if type(v) is Entry:
                used += v.footprint
                if not v.doomed:
                    bad.append(f"{key!r}: an Entry that is not doomed")
                if self._pins.get(key, 0) < 1:
                    bad.append(f"{key!r}: doomed but no reader holds it (never freed)")
                continue
            if type(v) is not int or v == 0:
                bad.append(f"{key!r}: slot {v!r} is neither an int nor an Entry")
                continue
            nb, fp = self._unpack(v)
            used += fp
            if v > 0:
                ready_count += 1
                ready_bytes += fp
            if self.located:
                c = v if v > 0 else -v
                if c in codes:
                    bad.append(f"{key!r} and {codes[c]!r} hold one location code {c}")
                codes[c] = key
            elif abs(v) != size_value(nb):
                bad.append(f"{key!r}: value {v} is not the shared value of its size {nb}")
            if v < 0 and key in self._pins:
                bad.append(f"{key!r}: a reservation is pinned")
        for key, n in self._pins.items():
            if n < 1 or key not in self._slots:
                bad.append(f"{key!r}: pinned {n} times, slot {self._slots.get(key)!r}")
            elif self.evictable_footprint([key]) is not None:
                bad.append(f"{key!r}: pinned but offered for eviction")
        if used != self.used:
            bad.append(f"used is {self.used}, the slots add up to {used}")
        if ready_count != self.ready_count or ready_bytes != self.ready_bytes:
            bad.append(f"ready_count/ready_bytes are {self.ready_count}/{self.ready_bytes}, "
                       f"the READY slots {ready_count}/{ready_bytes}")
        if self.used > self.tier.capacity_bytes:
            bad.append(f"used {self.used} exceeds the capacity {self.tier.capacity_bytes}")
        walked = list(OrderView(self))
        if len(walked) != ready_count or sum(fp for _, fp in walked) != ready_bytes:
            bad.append(f"the order yields {len(walked)} READY entries, the index holds {ready_count}")
        if self.ledger is not None and sum(self.ledger.usage.values()) != self.used:
            bad.append(f"the tenant ledger holds {sum(self.ledger.usage.values())} bytes, the index {self.used}")
        if bad:
            raise IndexInvariantError(f"tier {self.name!r}: " + "; ".join(bad[:8]))
