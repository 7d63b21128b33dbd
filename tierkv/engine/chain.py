"""``Chain``: the levels of a store, fastest first, the one lock and the call gate.

The chain holds what every part of the engine (``Writer``, ``Placer``, ``Reader``,
``Copier``) shares: the levels and the positions derived from them once (managed,
shared, write-behind, persistent), the one lock guarding all metadata, and the call
gate (``enter`` / ``leave``, ``shut``, ``wait_for_writes``).  It answers the questions
that span levels (where a key is READY, whether one is being written elsewhere) and is
the one place admission is asked (``admits``: every ``REJECT`` counted as ``rejected``,
every ``THROTTLED`` as ``throttled``).

State with an owner of its own is not here: each part's counters are that part's
(``Writer.counters`` ...), the tenants the ``Writer``'s (a put's tenant travels down the
put path as an argument), the ledger of chunks not durable ``Durability``'s
(``tierkv.engine.durable``), the removal listeners the store's (``RemovalListeners``, told
by the parts that remove), the leases the store's ``LeaseBook`` (``tierkv.engine.leases``,
given this chain's lock and managed levels) and the miss memory the store's ``Departures``
(``tierkv.engine.departures``), each handed by the store to the parts that use it.  Only this
module assigns a ``Chain`` attribute.

Every method whose docstring says "lock held" expects the caller to hold ``lock``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from tierkv.engine.level import Level
from tierkv.errors import ConfigError, StoreClosedError
from tierkv.outcome import Admission
from tierkv.tenants import OTHER, TenantLedger, Tenants

# why a chunk was not placed (bit flags gathered while scanning the chain)
NO_ROOM, UNAVAILABLE, FAILED, TOO_LARGE = 1, 2, 4, 8

#: a call's reservations not yet finished: (level position, key)
Held = dict[tuple[int, str], None]


class Chain:
    """The levels, fastest first, and their shared state (see the module docstring)."""

    def __init__(self, levels: Sequence[Level]) -> None:
        self.levels: list[Level] = list(levels)
        names = [lvl.name for lvl in self.levels]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"tier names must be unique; repeated: {sorted(dup)}")
        tiers_seen = [id(lvl.tier) for lvl in self.levels]
        if len(set(tiers_seen)) != len(tiers_seen):
            raise ConfigError("the same Tier object appears twice in the chain")
        owner: dict[int, str] = {}
        for lvl in self.levels:  # a policy keeps one tier's metadata: two tiers would each evict the other's keys
            if lvl.eviction is None:
                continue
            other = owner.setdefault(id(lvl.eviction), lvl.name)
            if other != lvl.name:
                raise ConfigError(f"tiers {other!r} and {lvl.name!r} share one eviction policy object "
                                  f"({type(lvl.eviction).__name__}); give each tier its own instance")
        for i, lvl in enumerate(self.levels):
            lvl.bind(1 << i)
        if len(self.levels) == 1:
            self.levels[0].alone()  # (no copy is made out of it: its integrity is chosen knowing that)
        #: some level keeps sums or carries them in its objects: a put computes each chunk's sum
        self.needs_sums = any(lvl.integrity.needs_sums for lvl in self.levels)
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)  # no call in flight (``close`` waits for it)
        self.settled = threading.Condition(self.lock)  # a put waiting for another call's write (``Writer``)
        self.settle_waiters = 0
        self.in_flight = 0
        self.closed = False
        #: positions of the managed levels (an index of their own) and of the shared pools
        self.managed = [i for i, lvl in enumerate(self.levels) if lvl.managed]
        self.shared = [i for i, lvl in enumerate(self.levels) if not lvl.managed]
        self.behind = [i for i, lvl in enumerate(self.levels) if lvl.write_behind]
        #: positions of the managed persistent levels (a chunk one of them holds is durable)
        self.persistent = [i for i in self.managed if self.levels[i].tier.persistent]
        self.any_write_through = any(lvl.write_through for lvl in self.levels)
        # only admission policies that observe demand are told about accesses (each once)
        self.observing = [a for a in {id(lvl.admission): lvl.admit for lvl in self.levels}.values() if a.observes]

    # ------------------------------------------------------------------ tenants
    def set_tenants(self, tenants: Tenants) -> None:
        """Keep ``tenants``' quotas: every managed level accounts its chunks per tenant (levels still empty).
        The tenants themselves are the ``Writer``'s (it names a put's label); the levels keep the ledgers."""
        for lvl in self.levels:
            if lvl.managed:
                lvl.set_quotas(TenantLedger(lvl.name, lvl.capacity, tenants))

    def label_of(self, key: str) -> str:
        """The tenant label a copy the store makes on its own (write-behind, demotion, promotion) charges
        ``key`` to: the one a managed level holding it charged it to, else ``OTHER`` (a chunk recovered from
        disk or found only in a shared pool).  A put names its tenant itself (``Placer.reserve``).  Lock held."""
        for j in self.managed:
            ledger = self.levels[j].ledger
            label = ledger.charged(key) if ledger is not None else None
            if label is not None:
                return label
        return OTHER

    # ------------------------------------------------------------------ calls in flight
    def enter(self) -> None:
        """A call begins (``StoreClosedError`` once the store is closed)."""
        with self.lock:
            if self.closed:
                raise StoreClosedError("the store is closed")
            self.in_flight += 1

    def enter_held(self) -> None:
        """A call begins, lock held, the caller having found the store open (``Reader.lookup``, before it asks
        the shared levels outside the lock)."""
        self.in_flight += 1

    def shut(self, timeout: float) -> bool:
        """Close the gate: no call begins from now on; wait up to ``timeout`` seconds for those in flight.
        Returns False when it was closed already.  Lock held."""
        if self.closed:
            return False
        self.closed = True
        self.idle.wait_for(lambda: self.in_flight == 0, timeout=timeout)
        return True

    def wait_for_writes(self, pending: Callable[[], bool], deadline: float) -> None:
        """Wait until ``pending()`` is false or ``time.monotonic()`` reaches ``deadline``, asking again each
        time a call ends (``leave``) and at least every 50 ms.  Lock held (released while waiting)."""
        self.settle_waiters += 1
        try:
            while pending():
                wait = deadline - time.monotonic()
                if wait <= 0:
                    break
                self.settled.wait(min(wait, 0.05))
        finally:
            self.settle_waiters -= 1

    def leave(self) -> None:
        """A call ends: wake ``close`` when none is left, and puts waiting for another call's write."""
        with self.lock:
            if self.settle_waiters:
                self.settled.notify_all()
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.notify_all()

    # ------------------------------------------------------------------ where keys are
    def mask(self, key: str) -> int:
        """Bitmask of the managed levels holding ``key`` READY (``level.bit``).  Lock held."""
        m = 0
        levels = self.levels
        for j in self.managed:
            lvl = levels[j]
            if lvl.holds(key):
                m |= lvl.bit
        return m

    def busy(self, key: str) -> bool:
        """READY or reserved (being written) in some managed level.  Lock held."""
        levels = self.levels
        return any(levels[j].busy(key) for j in self.managed)

    def writing_elsewhere(self, key: str) -> bool:
        """Whether ``key`` is reserved (being written) in some managed level and READY in none.  Lock held."""
        writing = False
        for j in self.managed:
            lvl = self.levels[j]
            if lvl.holds(key):
                return False
            writing = writing or lvl.reserved(key)
        return writing

    # ------------------------------------------------------------------ admission
    def admits(self, lvl: Level, key: str, nbytes: int) -> bool:
        """The one place a level's admission policy is asked, and its answer counted (``Level.admissions``; a
        ``REJECT`` in the level's ``rejected`` too); a ``REJECT`` or ``THROTTLED`` chunk goes on.  Lock held."""
        if lvl.admits_all:
            return True
        answer = lvl.admissions.record(lvl.admit.decide(key, nbytes))
        if answer is Admission.ADMIT:
            return True
        if answer is Admission.REJECT:
            lvl.counters.rejected += 1
        return False

    def accessed(self, keys: list[str]) -> None:
        """Tell the admission policies that observe demand of a batch asked for.  Lock held."""
        for adm in self.observing:
            adm.accessed(keys)

    # ------------------------------------------------------------------ reservations
    def release(self, held: Held) -> None:
        """Abort the reservations a call still holds (a path out through an exception)."""
        if held:
            with self.lock:
                for j, key in held:
                    self.levels[j].abort(key)
            held.clear()

    def finish_write(self, lvl: Level, key: str, nbytes: int, ok: bool, count_error: bool = True,
                     source: Level | None = None) -> bool:
        """Commit (ok) or abort a write into ``lvl``.  Lock held.  Returns whether it stays.

        ``source``: the level a copy the store makes on its own (write-behind, demotion,
        promotion) read the chunk from.  If the chunk is no longer READY there, a ``remove``
        ran while the copy was in flight: the copy is withdrawn, bytes and all, so what
        ``remove`` removed stays removed.
        """
        if ok and source is not None and source.managed and lvl.managed and not source.holds(key):
            lvl.withdraw(key)
            return False
        if lvl.managed:
            if ok:
                lvl.commit(key)
            else:
                lvl.abort(key)
        if ok:
            lvl.counters.puts += 1
            lvl.counters.bytes_written += nbytes
        elif count_error:
            lvl.counters.errors += 1
        return ok
