"""``Level``: one tier in the chain as the store sees it — the medium, its policies, its index.

A level owns the bookkeeping of a *managed* tier: the index of entries
(RESERVED, READY, or doomed-but-pinned), the bytes they account for, and the
pins of readers.  The index and its packed-int encoding are private to this
module: the store's reader, placer and copier ask typed, batched questions
(``holds``, ``ready_sizes``, ``probe_sized``, ``footprints``...), and an eviction
policy that follows the level's order sees it through ``LevelOrder``
(``policies/eviction.py``), where a token is opaque but for "READY is a positive
int".  The store decides *what* happens (placement, eviction, demotion); the
level makes each step keep its invariants:

* ``used`` is always the sum of ``footprint`` over the entries in ``index``
  and never exceeds ``capacity`` (``reserve`` refuses what does not fit);
* a READY entry is known to the eviction policy (told with its footprint, the
  one unit of size everywhere) and found by the store's reads; a RESERVED one
  is neither;
* the index holds one ``int`` per chunk (READY > 0, RESERVED < 0) and an
  ``Entry`` only for a doomed chunk a reader still holds; pins are counts in
  ``pinned`` (``entry`` gives a view of any state).  For a *located* tier (the
  slab under ``hbm`` and ``dram``) the int is the tier's location code, taken at
  ``reserve`` and given back when the chunk is freed, and the tier keeps nothing
  per object; for any other tier it is one shared value per size;
* a pinned entry is never freed: ``drop`` makes it unreadable at once, and the
  last ``unpin`` frees its space and deletes its bytes.

Giving chunks up: ``victims`` asks the policy and refuses an answer that names
a key the level does not hold READY, a pinned key, or one key twice
(``PolicyError``); a policy that frees too little is asked once more for the rest.
``evict_many`` drops each victim and releases the one pin the eviction holds on
it; a key another reader still holds stays readable to that reader (doomed) until
its last ``unpin``.  Every pin the call was given is released, raising or not.

Every method expects the caller to hold the store's lock.  A policy hook that
raises is reported as ``PolicyError`` *after* the level's own state is
consistent again, so the caller only has to release what it holds.  Policies
are called through ``tierkv.hooks`` (``CheckedEviction``, ``CheckedAdmission``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from itertools import repeat
from operator import neg as _neg
from typing import Any, Optional, Union

import numpy as np

from tierkv.checksum import Verify, parse_verify
from tierkv.errors import ConfigError, PolicyError
from tierkv.hooks import CheckedAdmission, CheckedEviction
from tierkv.outcome import AdmissionCounts
from tierkv.persist import PersistMode, resolve_persist
from tierkv.policies import AdmissionPolicy, EvictionPolicy, build_admission, build_eviction
from tierkv.stats import TierCounters
from tierkv.tenants import OTHER, TenantLedger
from tierkv.tiers.base import CODE_SHIFT, NB_FIELD, Locality, Tier

log = logging.getLogger("tierkv")

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


#: id(policy) -> the level it serves (weakly): one eviction policy object keeps one tier's metadata
_BOUND: dict[int, weakref.ref] = {}


def _bind_policy(policy: Any, level: Level) -> None:
    """Give ``policy`` to ``level``; ConfigError if it still serves another level whose tier is open.

    (A policy tracks the keys of one tier: given to two, each would name the other's keys as victims.)"""
    ref = _BOUND.get(id(policy))
    other = ref() if ref is not None else None
    if other is not None and other is not level and other.eviction is policy and other.tier.available:
        raise ConfigError(f"eviction policy object {type(policy).__name__} already serves tier {other.name!r}; "
                          f"give tier {level.name!r} its own instance")
    if len(_BOUND) > 256:  # forget the levels gone
        for k in [k for k, r in _BOUND.items() if r() is None]:
            del _BOUND[k]
    _BOUND[id(policy)] = weakref.ref(level)


def size_value(nbytes: int) -> int:
    """The READY value of a chunk of ``nbytes`` in a level whose tier is not located."""
    return nbytes << 1 | 1 if nbytes < NB_FIELD else nbytes << CODE_SHIFT | NB_FIELD << 1 | 1


class _Order:
    """A level's ``LevelOrder`` (``policies/eviction.py``): its entries, and what a policy may ask of them."""

    __slots__ = ("entries", "footprint", "ready_bytes", "ready_count")

    def __init__(self, level: Level) -> None:
        self.entries = level._index
        self.footprint = level._value_footprint
        self.ready_count = level.entries
        self.ready_bytes = lambda: level.ready_bytes


class Level:
    """One tier in the chain: the medium, its eviction and admission policies, and its index."""

    def __init__(
        self,
        tier: Tier,
        eviction: Union[str, EvictionPolicy, dict, None] = None,
        admission: Union[str, AdmissionPolicy, dict, None] = None,
        write_through: Optional[bool] = None,
        persist: Optional[str] = None,
        verify: Union[str, Verify, None] = None,
    ) -> None:
        if not isinstance(tier, Tier):
            raise TypeError(f"a level needs a Tier, got {type(tier).__name__}")
        self.tier = tier
        self.name = tier.name
        self.managed = tier.managed
        if not self.managed and eviction is not None:
            raise ConfigError(f"tier {tier.name!r} ({tier.medium}) manages its own space: it takes no 'eviction'")
        self.eviction: Optional[EvictionPolicy] = build_eviction(eviction) if self.managed else None
        if self.eviction is not None:
            _bind_policy(self.eviction, self)
            self.eviction.capacity_bytes = tier.capacity_bytes
        #: the eviction policy as the level calls it (None: an unmanaged level)
        self._policy = CheckedEviction(self.eviction, self.name) if self.eviction is not None else None
        self.admission: AdmissionPolicy = build_admission(admission)
        #: the admission policy as the store asks it (``admit``; ``admits_all`` for the default)
        self.admit = CheckedAdmission(self.admission, self.name)
        #: the admission admits everything: the store skips asking it
        self.admits_all = self.admit.admits_all
        #: what the admission answered, each answer the store acted on (``Chain.admits``)
        self.admissions = AdmissionCounts()
        self.persist = resolve_persist(tier, persist, write_through)
        if self.persist is PersistMode.WRITE_BEHIND and not self.managed:
            raise ConfigError(f"tier {tier.name!r} ({tier.medium}) is a shared pool: 'persist' may be "
                              "'write_through' or 'on_evict', not 'write_behind'")
        #: the tier leaves each object's location to this level (its code is the index int)
        self.located = tier.located and self.managed
        #: when reads are checked against the chunk's sum (``tierkv.checksum.Verify``)
        self.verify = parse_verify(Verify.EXTERNAL if verify is None else verify, f"tier {tier.name!r}")
        #: the level keeps each chunk's sum beside it (``sums``): a medium that holds bytes and keeps no sum
        self.keeps_sums = self.managed and tier.keeps_bytes and not tier.verifies_reads and not tier.sum_inside
        #: the engine checks this level's reads against ``sums``: always, or when its bytes can change outside
        self.checks_reads = self.keeps_sums and (self.verify is Verify.ALWAYS
                                                 or tier.locality in (Locality.REMOTE, Locality.DISK))
        #: key -> checksum of each chunk the level holds (a column beside the index; ``keeps_sums`` levels)
        self.sums: dict[str, int] = {}
        #: key -> int (> 0 READY, < 0 RESERVED) or, for a doomed chunk still read, an ``Entry``
        self._index: dict[str, Slot] = {}
        #: key -> number of readers holding it (the keys eviction must not name)
        self.pinned: dict[str, int] = {}
        self.used = 0
        self.ready_count = 0
        self.ready_bytes = 0  # footprint of the READY entries
        self.counters = TierCounters()
        #: chunks the store refused here (among ``counters.rejected``) as larger than the whole tier; ``stats()``
        #: adds the medium's own ``too_large`` (one fault reason of the medium's, in the exporter's terms)
        self.too_large = 0
        self.too_large_quiet = 0.0  # no "larger than the tier" line is logged before this (monotonic) time
        self.bit = 0
        self._canon: dict[int, int] = {}
        #: nbytes -> (footprint, shared reservation value): a medium's footprint is a function of nbytes alone
        self._fps: dict[int, tuple[int, int]] = {}
        self._fp_only: dict[int, int] = {}  # nbytes -> footprint (the same sizes as ``_fps``)
        if self.located:
            tier.attach(self.ready_codes)
        #: the eviction policy follows this level's order (it keeps no order of its own)
        self._follows = bool(self.eviction is not None and self.eviction.follows_level_order
                             and not len(self.eviction))
        if self._follows:
            self.eviction.follow_order(_Order(self))  # type: ignore[union-attr]
        #: per-tenant usage and the quota rules here (None: no tenant configured, nothing asked)
        self.ledger: Optional[TenantLedger] = None
        #: the label of the tenant a key is put under (``set_quotas``)
        self._label_of: Callable[[str], str] = lambda key: OTHER

    def set_quotas(self, ledger: TenantLedger, label_of: Callable[[str], str]) -> None:
        """Account this level's chunks per tenant (``label_of(key)``: the tenant of a key being placed) and keep
        their quotas: every reservation is charged, every freed chunk credited (the level is empty)."""
        self.ledger = ledger
        self._label_of = label_of

    @property
    def write_through(self) -> bool:
        return self.persist is PersistMode.WRITE_THROUGH

    @property
    def write_behind(self) -> bool:
        return self.persist is PersistMode.WRITE_BEHIND

    @property
    def capacity(self) -> int:
        return self.tier.capacity_bytes

    def bind(self, bit: int) -> None:
        """Join a store: ``bit`` marks this level in the masks the store builds (``1 << position``)."""
        self.bit = bit

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

    @property
    def policy_name(self) -> Optional[str]:
        """The eviction policy's name (None: an unmanaged level)."""
        return None if self.eviction is None else getattr(self.eviction, "name", type(self.eviction).__name__)

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

    # -- two-phase writes ------------------------------------------------------
    def reserve(self, key: str, nbytes: int) -> bool:
        """Reserve room for ``key`` without evicting; False if it is there already or does not fit."""
        return self.reserve_many([key], [nbytes]) == [0]

    def reserve_many(self, keys: list[str], sizes: list[int]) -> list[int]:
        """``reserve`` for each (key, nbytes) in order; one code each: 0 reserved now, 1 already READY or
        reserved here, 2 not reserved (no room without evicting, or a doomed copy is still read).

        For a located tier the space is taken here too (one ``allocate`` for the batch); a
        tier that fails to allocate costs those keys their reservation, nothing more.
        """
        index, cap, size = self._index, self.capacity, self._size
        fps = self._fps
        used = self.used
        ledger = self.ledger
        if (ledger is None and type(keys) is list and len(keys) > 1 and index.keys().isdisjoint(keys)
                and len(set(keys)) == len(keys)):
            # all new, all distinct (the common case): if the whole batch fits, reserve it in C loops
            fp_of = self._fp_only
            fps_all = list(map(fp_of.get, sizes))
            if None not in fps_all:
                total = sum(fps_all)  # type: ignore[arg-type]
                if used + total <= cap:
                    if not self.located:
                        index.update(zip(keys, [fps[nb][1] for nb in sizes]))
                        self.used = used + total
                        return [0] * len(keys)
                    codes = self._allocate(sizes)
                    if codes is not None:
                        index.update(zip(keys, [-c for c in codes]))  # type: ignore[operator]
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
                if key in index:
                    append(1 if type(index[key]) is int else 2)
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
                index[key] = c[1]
                used += fp
                fresh.append(len(out))
                append(0)
        finally:
            self.used = used
        if self.located and fresh:
            self._locate(keys, sizes, fresh, out)
        return out

    def _allocate(self, sizes: list[int]) -> Optional[list[Optional[int]]]:
        """The located tier's codes for ``sizes``; None when it failed (logged) or placed not all of them."""
        try:
            codes = self.tier.allocate(sizes)
            if len(codes) != len(sizes):
                raise RuntimeError(f"allocate answered {len(codes)} codes for {len(sizes)} sizes")
        except Exception as exc:  # noqa: BLE001 - a medium fault costs the reservations, never the call
            log.warning("tierkv: tier %s allocate failed: %s", self.name, exc)
            return None
        if None in codes:
            self.tier.free_at([c for c in codes if c is not None])
            return None
        return codes

    def _locate(self, keys: list[str], sizes: list[int], fresh: list[int], out: list[int]) -> None:
        """Give the reservations at ``fresh`` their located tier's codes (undo any the tier cannot place)."""
        index = self._index
        try:
            codes = self.tier.allocate([sizes[i] for i in fresh])
            if len(codes) != len(fresh):
                raise RuntimeError(f"allocate answered {len(codes)} codes for {len(fresh)} sizes")
        except Exception as exc:  # noqa: BLE001 - a medium fault costs the reservations, never the call
            log.warning("tierkv: tier %s allocate failed: %s", self.name, exc)
            codes = [None] * len(fresh)
        index.update([(keys[i], -c) for i, c in zip(fresh, codes) if c is not None])
        if None in codes:
            for i, c in zip(fresh, codes):
                if c is None:
                    del index[keys[i]]
                    self.used -= self._size(sizes[i])[0]
                    if self.ledger is not None:
                        self.ledger.credit(keys[i], self._size(sizes[i])[0])
                    out[i] = 2

    def commit(self, key: str) -> None:
        """Make a reservation READY: readable, known to the eviction policy."""
        self.commit_many([key])

    def commit_many(self, keys: list[str]) -> None:
        """``commit`` for a batch, with one policy call (``on_insert_many`` when the policy has it).

        If the policy raises, none of the batch stays: an entry the policy does not
        know could never be evicted.
        """
        index, shared = self._index, self._shared
        held: list[Any] = list(map(index.get, keys))
        if not held or set(map(type, held)) != _INT or max(held) >= 0:
            for key, v in zip(keys, held):
                if type(v) is not int or v > 0:
                    raise PolicyError(f"tier {self.name!r}: no reservation for {key[:80]!r}")
        ready = list(map(_neg, held))
        fps = self._fps
        nbs = [v >> 1 & _NB_MASK for v in ready]
        if _NB_MASK in nbs:
            nbs = [self._value_nbytes(v) for v in ready]
        got = list(map(fps.get, nbs))
        if None in got:
            got = [self._size(nb) for nb in nbs]
        if not self.located:
            ready = list(map(shared, ready))
        index.update(zip(keys, ready))
        sizes = [c[0] for c in got]  # type: ignore[index]
        self.ready_count += len(keys)
        self.ready_bytes += sum(sizes)
        if self._policy is None:
            return
        try:
            self._policy.inserted(keys, sizes)
        except BaseException:
            for key in keys:  # none of them may stay unknown to the policy
                if self.holds(key):
                    self._discard(key)
            self._policy.forget_quietly(keys)
            raise

    def adopt(self, keys: list[str], sizes: np.ndarray) -> bool:
        """Enter chunks the persistent medium recovered as READY, oldest first, in bulk (a store's open).

        ``sizes``: their nbytes, an int array.  The caller (``TieredStore._recover``) chose them: keys none
        of which is in the index, footprints that fit in the room left.  The index is loaded by C-level
        operations (one footprint and one shared value per distinct size, spread by numpy), and the
        eviction policy is told once, by ``on_adopt`` (``EvictionPolicy``'s default: ``on_insert_many``).
        Returns False, changing nothing, when some key is listed twice (the caller then picks the newest
        entry of each).  If the policy raises, none of the chunks stays.
        """
        n = len(keys)
        if not n:
            return True
        index = self._index
        if self.located or index:  # (no persistent medium is located today; the index is empty at open)
            if len(set(keys)) != n:
                return False
            codes = self.reserve_many(keys, [int(x) for x in sizes])
            self.commit_many([k for k, c in zip(keys, codes) if c == 0])
            return True
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
        if self.used + total > self.capacity:
            raise ValueError(f"tier {self.name!r}: {n} recovered chunks ({total} bytes) exceed the room left")
        index.update(zip(keys, repeat(v) if vals is None else vals))
        if len(index) != n:  # some key listed twice (the index was empty)
            index.clear()
            return False
        self.used += total
        self.ready_count += n
        self.ready_bytes += total
        if self.ledger is not None:  # (a recovered chunk's tenant is not known: it counts as OTHER's)
            self.ledger.usage[OTHER] += total
        policy = self._policy
        if policy is None:
            return True
        # (a policy following this level's order learns nothing from the sizes: no list of them is made for it)
        sizes_seq: Any = fps if self._follows else fps.tolist()
        try:
            policy.adopted(keys, sizes_seq)
        except BaseException:
            index.clear()  # (it held these alone) none of them may stay unknown to the policy
            if self.ledger is not None:
                self.ledger.usage[OTHER] -= total
            self.used -= total
            self.ready_count -= n
            self.ready_bytes -= total
            policy.forget_quietly(keys)
            raise
        return True

    def accessed(self, keys: list[str]) -> None:
        """Tell the eviction policy these READY keys were read (one call when it has ``on_access_many``)."""
        if keys and self._policy is not None:
            self._policy.accessed(keys)

    def abort(self, key: str) -> None:
        """Release a reservation whose write failed (or never ran)."""
        v = self._index.get(key)
        if type(v) is int and v < 0:  # type: ignore[operator]
            fp = self._unpack(v)[1]
            del self._index[key]
            self.sums.pop(key, None)
            self.used -= fp
            if self.ledger is not None:
                self.ledger.credit(key, fp)
            if self.located:
                self._give_back([-v])

    def withdraw(self, key: str) -> None:
        """Release a reservation whose bytes were written but must not stay (the chunk was removed while
        its copy was in flight): the reservation goes, and so do the bytes on the medium."""
        v = self._index.get(key)
        if type(v) is not int or v > 0:  # type: ignore[operator]
            return
        self.abort(key)
        if not self.located:  # (a located tier's bytes went with its code)
            try:
                self.tier.delete([key])
            except Exception as exc:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                log.warning("tierkv: tier %s delete failed: %s", self.name, exc)
                self.counters.errors += 1  # (the bytes stay on the medium: counted, not only logged)

    def _give_back(self, codes: list[int]) -> None:
        """Return a located tier's space (a fault is logged: the index no longer reaches those bytes)."""
        try:
            self.tier.free_at(codes)
        except Exception as exc:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
            log.warning("tierkv: tier %s free failed: %s", self.name, exc)
            self.counters.errors += 1  # (the bytes stay on the medium: counted, not only logged)

    # -- readers -----------------------------------------------------------------
    def pin(self, key: str) -> int:
        """Hold a READY ``key`` for a reader: never named as a victim nor freed until ``unpin``.

        Returns its nbytes.
        """
        v = self._index[key]
        if type(v) is not int or v < 0:  # type: ignore[operator]
            raise KeyError(f"tier {self.name!r}: {key[:80]!r} is not READY")
        pinned = self.pinned
        pinned[key] = pinned.get(key, 0) + 1
        return self._value_nbytes(v)  # type: ignore[arg-type]

    def pin_many(self, keys: list[str]) -> None:
        """``pin`` for each key (every one READY: the caller just checked, under the lock)."""
        pinned, index = self.pinned, self._index
        vals = list(map(index.get, keys))
        if set(map(type, vals)) != _INT or min(vals) < 0:  # type: ignore[type-var,operator]  # all or none
            for key, v in zip(keys, vals):
                if type(v) is not int or v < 0:  # type: ignore[operator]
                    raise KeyError(f"tier {self.name!r}: {key[:80]!r} is not READY")
        if not pinned and len(set(keys)) == len(keys):
            pinned.update(dict.fromkeys(keys, 1))
            return
        get = pinned.get
        for key in keys:
            pinned[key] = get(key, 0) + 1

    def unpin_many(self, keys: list[str]) -> None:
        """``unpin`` for each key."""
        pinned = self.pinned
        if (len(pinned) == len(keys) and set(map(pinned.get, keys)) == _ONE
                and set(map(type, map(self._index.get, keys))) == _INT):
            pinned.clear()  # exactly these keys, each pinned once, none doomed: nothing to free
            return
        for key in keys:
            n = pinned[key]
            if n == 1 and type(self._index.get(key)) is int:  # the common case: the last reader, not doomed
                del pinned[key]
            else:
                self.unpin(key)

    def unpin(self, key: str, _e: Any = None) -> None:
        """Release one ``pin``; the last one frees a chunk dropped meanwhile."""
        pinned = self.pinned
        n = pinned[key] - 1
        if n:
            pinned[key] = n
            return
        del pinned[key]
        v = self._index.get(key)
        if type(v) is Entry:  # dropped while read
            self._free_slot(key, v.footprint, v.code)

    # -- leaving -------------------------------------------------------------------
    def drop(self, key: str, _e: Any = None) -> None:
        """Make ``key`` unreadable now (a READY chunk leaves its policy); its space is freed when no reader
        holds it.  A doomed chunk is left as it is."""
        v = self._index.get(key)
        if type(v) is not int:
            return  # absent, or already doomed
        was_ready = v > 0  # type: ignore[operator]
        self._discard(key)
        if was_ready and self._policy is not None:
            self._policy.removed([key])

    def _discard(self, key: str) -> None:
        """Unmark ``key`` (an int in the index) and free it now, or doom it while a reader holds it."""
        v: int = self._index[key]  # type: ignore[assignment]
        nb, fp = self._unpack(v)
        if v > 0:
            self.ready_count -= 1
            self.ready_bytes -= fp
        code = (v if v > 0 else -v) if self.located else 0
        if key in self.pinned:
            e = self._index[key] = Entry(nb, fp, code=code)
            e.doomed = True
        else:
            self._free_slot(key, fp, code)

    def _free_slot(self, key: str, footprint: int, code: int = 0) -> None:
        del self._index[key]
        self.sums.pop(key, None)
        self.used -= footprint
        if self.ledger is not None:
            self.ledger.credit(key, footprint)
        if self.located:
            self._give_back([code])
            return
        try:
            self.tier.delete([key])
        except Exception as exc:  # the bytes are unreachable through the index either way  # noqa: BLE001 - a plug-in or medium fault is contained here by design
            log.warning("tierkv: tier %s delete failed: %s", self.name, exc)
            self.counters.errors += 1  # (the bytes stay on the medium: counted, not only logged)


    # -- eviction ------------------------------------------------------------------
    def evict_many(self, keys: list[str]) -> None:
        """``drop`` each key, then release the one pin the caller (an eviction) holds on it: a key no other
        reader holds is freed now, in one ``free_at`` / ``delete`` call for the batch."""
        index, pinned = self._index, self.pinned
        codes: list[int] = []
        gone: list[str] = []  # READY keys that left: the policy is told once, after the index is consistent
        done = 0
        vals: list[Any] = list(map(index.get, keys))
        if (vals and set(map(type, vals)) == _INT and min(vals) > 0 and set(map(pinned.get, keys)) == _ONE
                and len(set(keys)) == len(keys)):
            # the common case: distinct READY keys, each held by this eviction alone: all leave at once
            fields = [v >> 1 & _NB_MASK for v in vals]
            # (a field at the marker is a large chunk's: its size lives elsewhere)
            fps: list[Any] = list(map(self._fp_only.get, fields)) if _NB_MASK not in fields else [None]
            if None in fps:
                fps = [self._value_footprint(v) for v in vals]
            for key in keys:
                del pinned[key]
                del index[key]
            if self.sums:
                pop = self.sums.pop
                for key in keys:
                    pop(key, None)
            freed = sum(fps)
            if self.ledger is not None:
                for key, fp in zip(keys, fps):
                    self.ledger.credit(key, fp)
            self.ready_count -= len(keys)
            self.ready_bytes -= freed
            self.used -= freed
            codes, gone, done = vals, list(keys), len(keys)
            keys = []  # (nothing left for the loop below)
        try:
            for key in keys:
                done += 1
                v = index.get(key)
                if type(v) is not int or v < 0 or pinned.get(key) != 1:  # doomed, or read by others too
                    if type(v) is int and v > 0:
                        gone.append(key)
                        self._discard(key)
                    self.unpin(key)
                    continue
                del pinned[key]
                del index[key]
                self.sums.pop(key, None)
                self.ready_count -= 1
                fp = self._value_footprint(v)
                self.ready_bytes -= fp
                self.used -= fp
                if self.ledger is not None:
                    self.ledger.credit(key, fp)
                codes.append(v)
                gone.append(key)
        finally:
            for key in keys[done:]:  # a fault part way: the caller's pins on the rest are still released
                if key in pinned:
                    self.unpin(key)
            if codes:
                if self.located:
                    self._give_back(codes)
                else:
                    dead = [k for k in gone if k not in index]
                    try:
                        self.tier.delete(dead)
                    except Exception as exc:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                        log.warning("tierkv: tier %s delete failed: %s", self.name, exc)
                        self.counters.errors += 1  # (the bytes stay on the medium: counted, not only logged)
            if gone and self._policy is not None:
                self._policy.removed(gone)

    def _fast_victims(self, victims: list) -> Optional[int]:
        """The footprint bytes of ``victims`` when they pass every check at once (distinct READY keys of
        this level, none pinned, sizes remembered); None to check them one by one."""
        if not victims or set(map(type, victims)) != _STR or len(set(victims)) != len(victims):
            return None
        vals: list[Any] = list(map(self._index.get, victims))
        if set(map(type, vals)) != _INT or min(vals) < 0 or not self.pinned.keys().isdisjoint(victims):
            return None
        fields = [v >> 1 & _NB_MASK for v in vals]
        if _NB_MASK in fields:  # a large chunk's size lives elsewhere: the per-key path
            return None
        fps: list[Any] = list(map(self._fp_only.get, fields))
        return None if None in fps else sum(fps)

    def victims(self, need: int, tenant: Optional[str] = None, own_need: int = 0) -> Optional[list[str]]:
        """Ask the policy for victims freeing ``need`` footprint bytes, then check its answer.

        ``tenant`` (a level with quotas): the label of the put that needs the room, and ``own_need`` the
        bytes it must free of its own chunks to stay under its cap (see ``_quota_victims``)."""
        policy = self._policy
        if policy is None:
            return None
        if self.ledger is not None and tenant is not None:
            return self._quota_victims(max(need, own_need), tenant, own_need > 0)
        pname = policy.pname
        pinned = self.pinned
        # the pins as a read-only view: a policy cannot unpin a chunk being read by changing its argument
        victims = policy.victims(need, pinned.keys())
        if victims is None:
            return None
        freed, seen = 0, set()
        index = self._index
        fast = self._fast_victims(victims)
        if fast is not None:
            freed, seen = fast, set(victims)
            victims_to_check: list = []
        else:
            victims_to_check = victims
        for v in victims_to_check:
            fp = self._held_footprint(v, pname)
            if v in seen:
                raise PolicyError(f"eviction policy {pname} named {v[:80]!r} twice")
            seen.add(v)
            freed += fp
        if freed < need:
            # a policy that counts other sizes than the footprints it was given: ask for the rest
            more = policy.victims(need - freed, frozenset(pinned.keys() | seen))
            if more is None:
                return None
            for v in more:
                e = index.get(v) if isinstance(v, str) else None
                if v in seen or type(e) is not int or e < 0 or v in pinned:  # type: ignore[operator]
                    continue
                victims.append(v)
                seen.add(v)
                freed += self._unpack(e)[1]  # type: ignore[arg-type]
                if freed >= need:
                    break
            if freed < need:
                return None
        return victims

    def _held_footprint(self, v: Any, pname: str) -> int:
        """The footprint of victim ``v`` a policy named, or a ``PolicyError`` if the level does not hold it
        (held and ready) or it is pinned."""
        e = self._index.get(v) if isinstance(v, str) else None
        if type(e) is not int or e < 0:  # type: ignore[operator]
            raise PolicyError(f"eviction policy {pname} of tier {self.name!r} named {str(v)[:80]!r}, "
                              "which the tier does not hold (did on_remove forget it?)")
        if v in self.pinned:
            raise PolicyError(f"eviction policy {pname} named the protected key {v[:80]!r}")
        return self._value_footprint(e)  # type: ignore[arg-type]

    def _quota_victims(self, need: int, tenant: str, own_only: bool) -> Optional[list[str]]:
        """Victims for a put by ``tenant`` under quotas: the policy picks in its own order among the chunks
        the quota lets go (``QuotaGuard``: its own, and other tenants' only above their guaranteed bytes; only
        its own when ``own_only``); each key it names is checked, and the policy is asked again for what is
        still lacking while it names keys not seen yet."""
        policy, ledger = self._policy, self.ledger
        if policy is None or ledger is None:
            return None
        guard = ledger.guard(self.pinned.keys(), tenant, own_only)
        chosen: list[str] = []
        freed = 0
        while freed < need:
            answer = policy.victims(need - freed, guard)
            if answer is None:
                return None
            fresh = False
            for v in answer:
                fp = self._held_footprint(v, policy.pname)
                if v in guard.seen:
                    continue
                fresh = True
                guard.seen.add(v)
                if ledger.victim_ok(v, tenant, guard.taken, fp, own_only):
                    chosen.append(v)
                    freed += fp
                    if freed >= need:
                        break
            if not fresh:
                return None
        return chosen
