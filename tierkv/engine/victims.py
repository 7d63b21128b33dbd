"""Choosing victims: what a level gives up when it needs room, as its eviction policy names them, checked.

``choose_victims`` asks the policy (through ``CheckedEviction``) for victims freeing
``need`` footprint bytes and refuses an answer that names a key the level does not hold
READY, a pinned key, or one key twice (``PolicyError``); a policy that frees too
little is asked once more for the rest.  Under tenant quotas (a ``TenantLedger``) the
policy picks among what the quota lets go (``QuotaGuard``) and each key it names is
checked against the ledger.  Nothing here changes the level: ``Level.evict_many``
then drops what was chosen.  The caller holds the store's lock.
"""

from __future__ import annotations

from typing import Any, Optional

from tierkv.engine.levelindex import LevelIndex
from tierkv.errors import PolicyError
from tierkv.hooks import CheckedEviction
from tierkv.tenants import TenantLedger


def choose_victims(index: LevelIndex, policy: CheckedEviction, ledger: Optional[TenantLedger], need: int,
                   tenant: Optional[str] = None, own_need: int = 0) -> Optional[list[str]]:
    """Ask ``policy`` for victims in ``index`` freeing ``need`` footprint bytes, then check its answer.

    ``tenant`` (a level with quotas, ``ledger``): the label of the put that needs the room, and ``own_need``
    the bytes it must free of its own chunks to stay under its cap (see ``_quota_victims``).  None: the
    policy found too little."""
    if ledger is not None and tenant is not None:
        return _quota_victims(index, policy, ledger, max(need, own_need), tenant, own_need > 0)
    pname = policy.pname
    pinned = index.pinned
    # the pins as a read-only view: a policy cannot unpin a chunk being read by changing its argument
    victims = policy.victims(need, pinned.keys())
    if victims is None:
        return None
    freed, seen = 0, set()
    fast = index.evictable_footprint(victims)
    if fast is not None:
        freed, seen = fast, set(victims)
        victims_to_check: list = []
    else:
        victims_to_check = victims
    for v in victims_to_check:
        fp = _held_footprint(index, v, pname)
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
            fp = index.ready_footprint(v)
            if v in seen or fp < 0 or v in pinned:
                continue
            victims.append(v)
            seen.add(v)
            freed += fp
            if freed >= need:
                break
        if freed < need:
            return None
    return victims


def _held_footprint(index: LevelIndex, v: Any, pname: str) -> int:
    """The footprint of victim ``v`` a policy named, or a ``PolicyError`` if the level does not hold it
    (held and ready) or it is pinned."""
    fp = index.ready_footprint(v)
    if fp < 0:
        raise PolicyError(f"eviction policy {pname} of tier {index.name!r} named {str(v)[:80]!r}, "
                          "which the tier does not hold (did on_remove forget it?)")
    if v in index.pinned:
        raise PolicyError(f"eviction policy {pname} named the protected key {v[:80]!r}")
    return fp


def _quota_victims(index: LevelIndex, policy: CheckedEviction, ledger: TenantLedger, need: int, tenant: str,
                   own_only: bool) -> Optional[list[str]]:
    """Victims for a put by ``tenant`` under quotas: the policy picks in its own order among the chunks
    the quota lets go (``QuotaGuard``: its own, and other tenants' only above their guaranteed bytes; only
    its own when ``own_only``); each key it names is checked, and the policy is asked again for what is
    still lacking while it names keys not seen yet."""
    guard = ledger.guard(index.pinned.keys(), tenant, own_only)
    chosen: list[str] = []
    freed = 0
    while freed < need:
        answer = policy.victims(need - freed, guard)
        if answer is None:
            return None
        fresh = False
        for v in answer:
            fp = _held_footprint(index, v, policy.pname)
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
