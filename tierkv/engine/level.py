"""``Level``: one tier in the chain as the store sees it — the medium, its policies, its index.

A level owns the bookkeeping of a *managed* tier.  Its index (``LevelIndex``,
``tierkv/engine/levelindex.py``: one packed int per chunk, RESERVED, READY, or
doomed-but-pinned, and the typed, batched questions the store's reader, placer and
copier ask) is the base this class builds on; the encoding is private to those two
modules.  The store decides *what* happens (placement, eviction, demotion); the
level makes each step keep its invariants:

* ``used`` is always the sum of ``footprint`` over the entries in ``index``
  and never exceeds ``capacity`` (``reserve`` refuses what does not fit);
* a READY entry is known to the eviction policy (told with its footprint, the
  one unit of size everywhere) and found by the store's reads; a RESERVED one
  is neither;
* a located tier's code is taken at ``reserve`` and given back when the chunk is
  freed; any other tier's bytes are deleted when the chunk is freed;
* a pinned entry is never freed: ``drop`` makes it unreadable at once, and the
  last ``unpin`` frees its space and deletes its bytes.

Giving chunks up: ``victims`` asks the policy and refuses an answer that names
a key the level does not hold READY, a pinned key, or one key twice
(``PolicyError``); a policy that frees too little is asked once more for the rest
(``choose_victims``, ``tierkv/engine/victims.py``, with the tenant-quota search).
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
from tierkv.engine.levelindex import _INT, _NB_MASK, _ONE, Entry, LevelIndex, size_value
from tierkv.engine.victims import choose_victims
from tierkv.errors import ConfigError, PolicyError
from tierkv.hooks import CheckedAdmission, CheckedEviction
from tierkv.outcome import AdmissionCounts
from tierkv.persist import PersistMode, resolve_persist
from tierkv.policies import AdmissionPolicy, EvictionPolicy, build_admission, build_eviction
from tierkv.stats import TierCounters
from tierkv.tenants import OTHER, TenantLedger
from tierkv.tiers.base import Locality, Tier

log = logging.getLogger("tierkv")

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


class Level(LevelIndex):
    """One tier in the chain: the medium, its eviction and admission policies, and its index (``LevelIndex``)."""

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
        super().__init__(tier, located=tier.located and tier.managed)
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
        #: when reads are checked against the chunk's sum (``tierkv.checksum.Verify``)
        self.verify = parse_verify(Verify.EXTERNAL if verify is None else verify, f"tier {tier.name!r}")
        #: the level keeps each chunk's sum beside it (``sums``): a medium that holds bytes and keeps no sum
        self.keeps_sums = self.managed and tier.keeps_bytes and not tier.verifies_reads and not tier.sum_inside
        #: the engine checks this level's reads against ``sums``: always, or when its bytes can change outside
        self.checks_reads = self.keeps_sums and (self.verify is Verify.ALWAYS
                                                 or tier.locality in (Locality.REMOTE, Locality.DISK))
        #: key -> checksum of each chunk the level holds (a column beside the index; ``keeps_sums`` levels)
        self.sums: dict[str, int] = {}
        self.counters = TierCounters()
        #: chunks the store refused here (among ``counters.rejected``) as larger than the whole tier; ``stats()``
        #: adds the medium's own ``too_large`` (one fault reason of the medium's, in the exporter's terms)
        self.too_large = 0
        self.too_large_quiet = 0.0  # no "larger than the tier" line is logged before this (monotonic) time
        self.bit = 0
        if self.located:
            tier.attach(self.ready_codes)
        #: the eviction policy follows this level's order (it keeps no order of its own)
        self._follows = bool(self.eviction is not None and self.eviction.follows_level_order
                             and not len(self.eviction))
        if self._follows:
            self.eviction.follow_order(self.level_order())  # type: ignore[union-attr]
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

    @property
    def policy_name(self) -> Optional[str]:
        """The eviction policy's name (None: an unmanaged level)."""
        return None if self.eviction is None else getattr(self.eviction, "name", type(self.eviction).__name__)

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

        ``sizes``: their nbytes, an int array.  The caller (``tierkv.engine.recovery.recover``) chose them: keys none
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

    def victims(self, need: int, tenant: Optional[str] = None, own_need: int = 0) -> Optional[list[str]]:
        """Ask the policy for victims freeing ``need`` footprint bytes, then check its answer (``choose_victims``).

        ``tenant`` (a level with quotas): the label of the put that needs the room, and ``own_need`` the
        bytes it must free of its own chunks to stay under its cap."""
        if self._policy is None:
            return None
        return choose_victims(self, self._policy, self.ledger, need, tenant, own_need)
