"""What ``TieredStore.stats()`` reports, gathered from the chain under its lock.

``collect_stats`` answers the figures of each tier (its level's counters, the
medium's own ``extra_stats``, which never override the level's), the store's totals
(sums over the tiers, and from their owners: the chain's calls in flight, the
``LeaseBook``'s leases, the write-behind queue and what it dropped, the ``Departures``'
misses by reason) and, with tenants
configured, each tenant's usage and hits over the managed tiers.  The store then
adds what its observers count (outside the lock) and shapes the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from tierkv.engine.chain import Chain
from tierkv.engine.departures import Departures
from tierkv.engine.durable import Durability
from tierkv.engine.leases import LeaseBook
from tierkv.engine.level import Level
from tierkv.stats import StoreCounters

#: the tiers' figures the store's totals are the sums of
SUMMED = ("capacity_bytes", "used_bytes", "evictions", "promotions", "demotions", "errors", "corrupt",
          "rejected", "bytes_read", "bytes_written", "persisted")


def collect_stats(chain: Chain, durability: Durability, leases: LeaseBook, departures: Departures,
                  write_behind_pending: Callable[[], int], counters: Sequence[Any], with_tenants: bool = False
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, Any], Optional[dict[str, Any]]]:
    """(tier name -> its figures, the totals, label -> a tenant's figures or None without tenants).

    ``durability``: the store's ledger of chunks not durable (``write_behind_*``); ``leases``: the store's
    ``LeaseBook`` (``leases_active`` and its counters); ``departures``: the store's miss memory
    (``misses_by_reason``, ``miss_memory*``).  ``counters``: the engine parts' own counters (``Writer``,
    ``Reader``, ``Copier``), gathered with the leases' into the totals in the order ``StoreCounters`` names them;
    ``with_tenants``: the store has tenants configured (each tenant's figures are answered).
    Takes the chain's lock; a lease past its deadline is expired first (and counted as such)."""
    tiers: dict[str, dict[str, Any]] = {}
    with chain.lock:
        if not chain.closed:
            leases.expire()  # (a lease past its deadline is counted as such when asked)
        for lvl in chain.levels:
            tiers[lvl.name] = _tier_stats(lvl)
        total: dict[str, Any] = StoreCounters.of(*counters, leases.counters).as_dict()
        for field in SUMMED:
            total[field] = sum(t[field] for t in tiers.values())
        total["in_flight"] = chain.in_flight
        total["leases_active"] = leases.active
        total["write_behind_pending"] = write_behind_pending()
        total["write_behind_dropped"] = durability.drops.total
        total["write_behind_not_durable"] = durability.not_durable()
        total["write_behind_dropped_by_reason"] = durability.drops.by_reason()
        total["misses_by_reason"] = departures.counts_by_reason()
        total["miss_memory"] = departures.capacity
        total["miss_memory_used"] = len(departures)
        tenants = _tenant_stats(chain.levels) if with_tenants else None
    return tiers, total, tenants


def _tier_stats(lvl: Level) -> dict[str, Any]:
    """One tier's figures: its level's counters, then the medium's own (lock held)."""
    d: dict[str, Any] = {
        "medium": lvl.tier.medium,
        "locality": getattr(lvl.tier, "locality", "host"),
        "persist": lvl.persist,
        "capacity_bytes": lvl.capacity,
        "used_bytes": lvl.used if lvl.managed else lvl.tier.used_bytes,
        "stored_bytes": lvl.tier.used_bytes,
        "entries": lvl.entries() if lvl.managed else None,
        "available": bool(lvl.tier.available),
        **lvl.counters.as_dict(),
    }
    if lvl.eviction is not None:
        d["eviction"] = getattr(lvl.eviction, "name", type(lvl.eviction).__name__)
        d["eviction_policy"] = lvl.policy_report()  # (its memory_bytes and counters)
    d["admission"] = lvl.admissions.as_dict()  # (each answer the store acted on)
    try:
        extra = lvl.tier.extra_stats()
    except Exception as e:  # noqa: BLE001 - a medium's stats never break stats()
        extra = {"extra_stats_error": str(e)}
    for k, v in extra.items():
        d.setdefault(k, v)
    mine = extra.get("too_large")  # (refused by the store as larger than the tier, or by the medium)
    d["too_large"] = lvl.too_large + (mine if isinstance(mine, int) else 0)
    own = extra.get("corrupt")  # (a medium that checks its own records counts what it dropped)
    d["corrupt"] = lvl.counters.corrupt + (own if isinstance(own, int) else 0)
    return d


def _tenant_stats(levels: list[Level]) -> dict[str, Any]:
    """label -> {used_bytes, hits (totals over the managed tiers), tiers: {tier: that tier's figures}}
    (lock held)."""
    out: dict[str, Any] = {}
    for lvl in levels:
        if lvl.ledger is None:
            continue
        for label, d in lvl.ledger.snapshot().items():
            t = out.setdefault(label, {"used_bytes": 0, "hits": 0, "tiers": {}})
            t["used_bytes"] += d["used_bytes"]
            t["hits"] += d["hits"]
            t["tiers"][lvl.name] = d
    return out
