"""``Level``: one tier in the chain as the store sees it — the medium, its policies, its index.

Ownership: a level owns its index (``self.index``, a ``LevelIndex``,
``tierkv/engine/levelindex.py``), its eviction and admission policies, its integrity
strategy (``self.integrity``, ``tierkv/engine/integrity.py``: chosen once, from the medium's
declarations and the ``verify`` option; the chunk sums it keeps, if any, are its), and its
counters.  The index alone knows
the packed encoding and alone changes the per-chunk state (slots, pins, byte counts, tenant
charges), through its batched mutators; the level calls them and does what they ask of the
medium (a located tier's ``allocate`` / ``free_at``, any other tier's ``delete``) and of the
policy (told of each chunk that became READY, was read, or left).  The store's reader,
placer and copier ask the index's typed questions through the level (``lvl.holds`` is
``lvl.index.holds``, bound once) and read ``used``, ``ready_count``, ``ready_bytes`` and
``pinned`` as properties; nobody outside the index writes them.

The store decides *what* happens (placement, eviction, demotion); the level makes each step
keep its invariants (those of the index, ``LevelIndex.check``, and):

* a READY entry is known to the eviction policy (told with its footprint, the one unit of
  size everywhere) and found by the store's reads; a RESERVED one is neither;
* a located tier's code is taken at ``reserve`` and given back when the chunk is freed; any
  other tier's bytes are deleted when the chunk is freed, and its sum forgotten;
* a pinned entry is never freed: ``drop`` makes it unreadable at once, and the last
  ``unpin`` frees its space and deletes its bytes;
* an eviction policy that follows the level's order (``follows_level_order``) is handed the
  index's ``OrderView`` before first use, and never the mapping itself.

Giving chunks up: ``victims`` asks the policy and refuses an answer that names a key the
level does not hold READY, a pinned key, or one key twice (``PolicyError``); a policy that
frees too little is asked once more for the rest (``choose_victims``,
``tierkv/engine/victims.py``, with the tenant-quota search).  ``evict_many`` drops each
victim and releases the one pin the eviction holds on it; a key another reader still holds
stays readable to that reader (doomed) until its last ``unpin``.  Every pin the call was
given is released, raising or not.

Every method expects the caller to hold the store's lock.  A policy hook that raises is
reported as ``PolicyError`` *after* the level's own state is consistent again, so the caller
only has to release what it holds.  Policies are called through ``tierkv.hooks``
(``CheckedEviction``, ``CheckedAdmission``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Optional, Union

import numpy as np

from tierkv.checksum import Verify, parse_verify
from tierkv.engine.indexcheck import check_index
from tierkv.engine.integrity import Integrity, select
from tierkv.engine.levelindex import Freed, LevelIndex
from tierkv.engine.victims import choose_victims
from tierkv.errors import ConfigError, PolicyError
from tierkv.hooks import CheckedAdmission, CheckedEviction
from tierkv.outcome import AdmissionCounts
from tierkv.persist import PersistMode, resolve_persist
from tierkv.policies import AdmissionPolicy, EvictionPolicy, build_admission, build_eviction
from tierkv.stats import TierCounters
from tierkv.tenants import OTHER, TenantLedger
from tierkv.tiers.base import Tier

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


def _read_through(path: str, doc: str) -> Any:
    """A read-only property of the level that answers ``path`` (``"index.used"``) from the part that owns it
    (one C-level ``attrgetter``: as fast as the attribute itself, and nobody can assign it on the level)."""
    return property(attrgetter(path), doc=doc)


class Level:
    """One tier in the chain: the medium, its eviction and admission policies, and its index (``self.index``)."""

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
        #: the tier leaves each object's location to this level (its code is the index int)
        self.located = tier.located and tier.managed
        #: this level's index: the only keeper of the per-chunk state (see the module docstring)
        self.index = ix = LevelIndex(tier, self.located)
        # the index's typed questions, answered by the index itself (bound once: no forwarding cost)
        self.holds = ix.holds
        self.knows = ix.knows
        self.knows_none = ix.knows_none
        self.busy = ix.busy
        self.reserved = ix.reserved
        self.not_dropped = ix.not_dropped
        self.none_dropped = ix.none_dropped
        self.all_ready = ix.all_ready
        self.leading_ready = ix.leading_ready
        self.lacking = ix.lacking
        self.ready_nbytes = ix.ready_nbytes
        self.ready_sizes = ix.ready_sizes
        self.ready_codes = ix.ready_codes
        self.probe_sized = ix.probe_sized
        self.codes = ix.codes
        self.nbytes_of = ix.nbytes_of
        self.footprint = ix.footprint
        self.footprints = ix.footprints
        self.entry = ix.entry
        self.entries = ix.entries
        self.items = ix.items
        self.keys = ix.keys
        self.ready_keys = ix.ready_keys
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
        #: how this level keeps chunk sums and checks reads (``tierkv.engine.integrity``): chosen here, once
        self.integrity: Integrity = select(tier, self.managed, self.verify)
        self.counters = TierCounters()
        #: chunks the store refused here (among ``counters.rejected``) as larger than the whole tier; ``stats()``
        #: adds the medium's own ``too_large`` (one fault reason of the medium's, in the exporter's terms)
        self.too_large = 0
        self.too_large_quiet = 0.0  # no "larger than the tier" line is logged before this (monotonic) time
        self.bit = 0
        if self.located:
            tier.attach(ix.ready_codes)
        #: the eviction policy follows this level's order (it keeps no order of its own)
        self._follows = bool(self.eviction is not None and self.eviction.follows_level_order
                             and not len(self.eviction))
        if self._follows:
            self.eviction.follow_order(ix.order())  # type: ignore[union-attr]

    # -- what the index and the integrity strategy hold, read-only ---------------------------
    used: int = _read_through("index.used", "Footprint bytes of every chunk here (READY, RESERVED, doomed).")
    ready_count: int = _read_through("index.ready_count", "How many READY chunks the level holds.")
    ready_bytes: int = _read_through("index.ready_bytes", "Footprint bytes of the READY chunks.")
    pinned: MappingProxyType = _read_through("index.pinned", "key -> readers holding it, read-only.")
    ledger: Optional[TenantLedger] = _read_through(
        "index.ledger", "Per-tenant usage and the quota rules here (None: no tenant configured, nothing asked).")
    keeps_sums: bool = _read_through(
        "integrity.keeps_sums", "The level keeps each chunk's sum beside it (``sums``; its ``integrity`` says).")
    checks_reads: bool = _read_through(
        "integrity.checks_reads", "The engine checks every read of this level (its ``integrity`` says).")
    sums: Mapping[str, int] = _read_through(
        "integrity.sums", "key -> the sum kept of each chunk the level holds, read-only (empty unless ``keeps_sums``).")

    def set_quotas(self, ledger: TenantLedger) -> None:
        """Account this level's chunks per tenant and keep their quotas: every reservation is charged to the
        tenant ``reserve_many`` is given, every freed chunk credited (the level is empty)."""
        self.index.set_quotas(ledger)

    def alone(self) -> None:
        """This level is its chain's only one: no copy is ever made out of it, so sums kept for no check
        would serve nothing; its integrity is chosen again knowing that (``select``'s ``alone``), once, when
        the chain is built (any sum kept so far goes with the strategy that kept it)."""
        self.integrity = select(self.tier, self.managed, self.verify, alone=True)

    def check(self) -> None:
        """Verify the index's invariants (``check_index``) and the level's own: a policy that follows the
        level tracks exactly its READY chunks, and a sum is kept only for a chunk the index holds."""
        check_index(self.index)
        bad = []
        if self.eviction is not None and len(self.eviction) != self.index.ready_count:
            bad.append(f"the policy tracks {len(self.eviction)} chunks, the index holds {self.index.ready_count}")
        stray = [k for k in self.sums if not self.index.knows(k)]
        if stray:
            bad.append(f"sums kept for {len(stray)} chunks not in the index (first {stray[0]!r})")
        if bad:
            raise AssertionError(f"tier {self.name!r}: " + "; ".join(bad))

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

    def policy_report(self) -> Optional[dict[str, Any]]:
        """The eviction policy's own figures (None: an unmanaged level): ``memory_bytes`` and ``counters``, as the
        policy answers them; a policy whose report fails gives ``{"error": ...}`` (stats never break on it)."""
        if self._policy is None:
            return None
        try:
            return self._policy.report()
        except PolicyError as e:
            return {"error": str(e)}

    # -- two-phase writes ------------------------------------------------------
    def reserve(self, key: str, nbytes: int, tenant: Optional[str] = None) -> bool:
        """Reserve room for ``key`` without evicting; False if it is there already or does not fit."""
        return self.reserve_many([key], [nbytes], tenant) == [0]

    def reserve_many(self, keys: list[str], sizes: list[int], tenant: Optional[str] = None) -> list[int]:
        """``LevelIndex.reserve`` for each (key, nbytes) in order: 0 reserved now, 1 already READY or reserved
        here, 2 not reserved.  For a located tier the space is taken here too (one ``allocate`` for the batch);
        a tier that fails to allocate costs those keys their reservation, nothing more.

        ``tenant``: the label every reservation is charged to and held to the quota of, on a level with
        quotas (None: ``OTHER``, as for a recovered chunk); ignored without quotas.  Lock held."""
        return self.index.reserve(keys, sizes, self._allocate if self.located else None,
                                  OTHER if tenant is None else tenant)

    def _allocate(self, sizes: list[int]) -> list[Optional[int]]:
        """The located tier's codes for ``sizes`` (None where one was not placed; a fault is logged and places
        none)."""
        try:
            codes = self.tier.allocate(sizes)
            if len(codes) != len(sizes):
                raise RuntimeError(f"allocate answered {len(codes)} codes for {len(sizes)} sizes")
        except Exception as exc:  # noqa: BLE001 - a medium fault costs the reservations, never the call
            log.warning("tierkv: tier %s allocate failed: %s", self.name, exc)
            return [None] * len(sizes)
        return codes

    def commit(self, key: str) -> None:
        """Make a reservation READY: readable, known to the eviction policy."""
        self.commit_many([key])

    def commit_many(self, keys: list[str]) -> None:
        """``commit`` for a batch, with one policy call (``on_insert_many`` when the policy has it).

        If the policy raises, none of the batch stays: an entry the policy does not
        know could never be evicted.
        """
        sizes = self.index.commit(keys)
        if self._policy is None:
            return
        try:
            self._policy.inserted(keys, sizes)
        except BaseException:
            self._release(self.index.drop(keys)[1])  # none of them may stay unknown to the policy
            self._policy.forget_quietly(keys)
            raise

    def adopt(self, keys: list[str], sizes: np.ndarray) -> bool:
        """Enter chunks the persistent medium recovered as READY, oldest first, in bulk (a store's open).

        ``sizes``: their nbytes, an int array.  The caller (``tierkv.engine.recovery.recover``) chose them:
        keys none of which is in the index, footprints that fit in the room left.  The eviction policy is
        told once, by ``on_adopt`` (``EvictionPolicy``'s default: ``on_insert_many``).  Returns False, changing
        nothing, when some key is listed twice (the caller then picks the newest entry of each).  If the
        policy raises, none of the chunks stays.
        """
        n = len(keys)
        if not n:
            return True
        if self.located or self.index.keys():
            # (no persistent medium is located today; the index is empty at open)
            if len(set(keys)) != n:
                return False
            codes = self.reserve_many(keys, [int(x) for x in sizes])
            self.commit_many([k for k, c in zip(keys, codes) if c == 0])
            return True
        policy = self._policy

        def tell(fps: np.ndarray) -> None:
            if policy is not None:
                # (a policy following this level's order learns nothing from the sizes: no list made for it)
                try:
                    policy.adopted(keys, fps if self._follows else fps.tolist())  # type: ignore[arg-type]
                except BaseException:
                    policy.forget_quietly(keys)
                    raise

        return self.index.adopt(keys, sizes, tell)

    def accessed(self, keys: list[str]) -> None:
        """Tell the eviction policy these READY keys were read (one call when it has ``on_access_many``)."""
        if keys and self._policy is not None:
            self._policy.accessed(keys)

    def abort(self, key: str) -> None:
        """Release a reservation whose write failed (or never ran)."""
        self._release(self.index.abort([key]), delete=False)

    def withdraw(self, key: str) -> None:
        """Release a reservation whose bytes were written but must not stay (the chunk was removed while
        its copy was in flight): the reservation goes, and so do the bytes on the medium."""
        self._release(self.index.abort([key]))

    def _release(self, freed: Freed, delete: bool = True) -> None:
        """Give the medium back what the index freed: a located tier's codes (``free_at``), any other tier's
        bytes (``delete``; not for a reservation never written, ``delete=False``); forget their sums.  A fault
        is logged and counted: the index no longer reaches those bytes."""
        keys = freed.keys
        if not keys:
            return
        self.integrity.forget(keys)
        try:
            if self.located:
                self.tier.free_at(freed.codes)
            elif delete:
                self.tier.delete(keys)
            else:
                return
        except Exception as exc:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
            log.warning("tierkv: tier %s %s failed: %s", self.name, "free" if self.located else "delete", exc)
            self.counters.errors += 1  # (the bytes stay on the medium: counted, not only logged)

    # -- readers -----------------------------------------------------------------
    def pin(self, key: str) -> int:
        """Hold a READY ``key`` for a reader: never named as a victim nor freed until ``unpin``.

        Returns its nbytes.
        """
        self.index.pin([key])
        return self.index.nbytes_of(key)

    def pin_many(self, keys: list[str]) -> None:
        """``pin`` for each key (every one READY: the caller just checked, under the lock)."""
        self.index.pin(keys)

    def unpin_many(self, keys: list[str]) -> None:
        """``unpin`` for each key."""
        freed = self.index.unpin(keys)
        if freed.keys:
            self._release(freed)

    def unpin(self, key: str) -> None:
        """Release one ``pin``; the last one frees a chunk dropped meanwhile."""
        self.unpin_many([key])

    # -- leaving -------------------------------------------------------------------
    def drop(self, key: str) -> None:
        """Make ``key`` unreadable now (a READY chunk leaves its policy); its space is freed when no reader
        holds it.  A doomed chunk is left as it is."""
        was_ready, freed = self.index.drop([key])
        self._release(freed)
        if was_ready and self._policy is not None:
            self._policy.removed(was_ready)

    def evict_many(self, keys: list[str]) -> None:
        """``drop`` each key, then release the one pin the caller (an eviction) holds on it: a key no other
        reader holds is freed now, in one ``free_at`` / ``delete`` call for the batch."""
        gone: list[str] = []
        freed = Freed([], [])
        try:
            self.index.evict(keys, gone, freed)
        finally:
            self._release(freed)
            if gone and self._policy is not None:
                self._policy.removed(gone)

    def victims(self, need: int, tenant: Optional[str] = None, own_need: int = 0) -> Optional[list[str]]:
        """Ask the policy for victims freeing ``need`` footprint bytes, then check its answer (``choose_victims``).

        ``tenant`` (a level with quotas): the label of the put that needs the room, and ``own_need`` the
        bytes it must free of its own chunks to stay under its cap."""
        if self._policy is None:
            return None
        return choose_victims(self.index, self._policy, self.index.ledger, need, tenant, own_need)
