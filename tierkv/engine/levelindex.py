"""``LevelIndex``: the packed index of one managed level, the only keeper of its encoding.

Ownership: a ``Level`` (``tierkv/engine/level.py``) builds one ``LevelIndex`` and holds it as
``level.index``; nothing else writes to it.  The index owns the per-chunk state of its level
(the slots, the pins, the byte counts, the tenant charges) and changes it only through its
batched mutators: ``reserve``, ``commit``, ``abort``, ``pin``, ``unpin``, ``drop``, ``evict``
(and ``adopt``, ``reserve`` and ``commit`` at once for the chunks a persistent medium
recovered at a store's open).  A mutator never calls the medium: what it frees comes back as
a ``Freed`` (keys, and a located tier's codes), which the level gives back to its tier.
Everyone else asks typed, batched questions (``holds``, ``ready_sizes``, ``probe_sized``...: the
base class ``IndexQueries``, ``indexqueries.py``), and an eviction policy that follows the level's
order sees it through an ``OrderView`` (``orderview.py``: an iterator of READY entries and
``move_to_end``), never the mapping.  Every call is made under
the store's lock.

The encoding: one ``int`` per chunk, READY > 0, RESERVED < 0 (the negation), and an ``Entry``
only for a chunk dropped while a reader holds it (*doomed*).  A READY int is
``X << CODE_SHIFT | f << 1 | 1`` (never 0), ``f`` the nbytes below ``NB_FIELD`` and
``NB_FIELD`` at or past it.  For a *located* tier (the slab under ``hbm`` and ``dram``) the
int is the tier's location code, built by the tier from the constants here, taken at
``reserve`` and given back when the chunk is freed; for any other tier ``X`` is 0 (or nbytes
for a large chunk) and the value is one shared object per size.

Invariants (``check_index``, ``indexcheck.py``, verifies each of them; ``Level.check`` calls it):

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

from collections.abc import Callable
from itertools import repeat
from operator import neg as _neg
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from tierkv.engine.indexcheck import check_index
from tierkv.engine.indexqueries import _INT, _NB_MASK, Entry, IndexQueries, Slot, size_value
from tierkv.engine.orderview import OrderView
from tierkv.errors import PolicyError
from tierkv.tenants import OTHER

if TYPE_CHECKING:
    from tierkv.tenants import TenantLedger
    from tierkv.tiers.base import Tier

#: each batched mutator's fast path, on (True) or off: the per-key path then does every step
FAST: dict[str, bool] = {"reserve": True, "commit": True, "pin": True, "unpin": True, "evict": True}

_ONE = {1}


class Freed(NamedTuple):
    """What a mutator freed, for the level to give back to its tier: the keys, and a located tier's codes."""

    keys: list[str]
    codes: list[int]


class LevelIndex(IndexQueries):
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
        #: per-tenant usage (None: no tenant configured)
        self.ledger: Optional[TenantLedger] = None

    def check(self) -> None:
        """Verify every invariant of this index (``check_index``); raises ``IndexInvariantError`` naming the
        first one broken.  Tests call it (or ``Level.check``) instead of reading the index's mappings."""
        check_index(self)

    def set_quotas(self, ledger: TenantLedger) -> None:
        """Charge every reservation to the tenant ``reserve`` is given, in ``ledger``, and credit every freed
        slot (the index is empty)."""
        if self._slots:
            raise RuntimeError(f"tier {self.name!r}: quotas are set on an empty level")
        self.ledger = ledger

    def order(self) -> OrderView:
        """The view of this index an eviction policy that follows the level's order is given."""
        return OrderView(self)

    # -- the mutators ----------------------------------------------------------------
    def reserve(self, keys: list[str], sizes: list[int],
                allocate: Optional[Callable[[list[int]], list[Optional[int]]]] = None,
                tenant: str = OTHER) -> list[int]:
        """Reserve room for each (key, nbytes) in order, without evicting; one code each: 0 reserved now,
        1 already READY or reserved here, 2 not reserved (no room, over the tenant's cap, a doomed copy
        still read, or the tier could not place it).

        A located tier's level passes ``allocate`` (its tier's codes for some sizes, None where one was
        not placed; never raising): the codes are taken here.  ``tenant``: the label every reservation of
        the batch is charged to and held to the cap of, with a ledger (``OTHER``: a chunk of no tenant's,
        as a recovered one); ignored without one.
        """
        if type(tenant) is not str:
            raise TypeError(f"tier {self.name!r}: a reservation's tenant is a label (str), "
                            f"got {type(tenant).__name__}")
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
                    if ledger.over_cap(tenant, fp):  # (room must come from the tenant's own chunks: evict first)
                        append(2)
                        continue
                    ledger.charge(key, tenant, fp)
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
