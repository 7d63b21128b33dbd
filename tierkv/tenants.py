"""Tenant quotas: what each configured tenant may hold in each managed tier.

A tenant is a name a put is made under (the vLLM connector passes a request's
``cache_salt``); a name that is not configured counts as ``OTHER``, so the labels
are the configured set plus one, however many names the puts carry.

Config shape (the store's top-level ``"tenants"``)::

    "tenants": {
      "alice": {"dram": {"cap_bytes": "1GiB"}},   # a hard cap in that tier
      "bob":   {"dram": {"share": 0.5}}           # a guaranteed share of that tier's capacity
    }

Per tenant and tier, exactly one of ``cap_bytes`` (a size: an int or a unit string) or
``share`` (a fraction in (0, 1]); the shares of one tier sum to at most 1.

The rules a ``TenantLedger`` answers for one tier (the invariant of docs/architecture.md):

* **cap**: a tenant's usage (footprint bytes of its chunks, reserved or ready) never exceeds its
  cap; a put that would cross it makes room among that tenant's own chunks, or is refused;
* **share**: a tenant whose usage is at or under its guaranteed bytes (``share`` × capacity)
  loses chunks only to its own puts: another tenant's put may take its chunks only above that line.

Nothing here is asked when no tenant is configured (the store then holds no ledger).
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable
from dataclasses import dataclass
from typing import Any, Optional

from tierkv.errors import ConfigError
from tierkv.options import check_float, check_str, short
from tierkv.units import parse_size

#: the label of every chunk put under a name that is not a configured tenant (or under none)
OTHER = "other"

_QUOTA_KEYS = ("cap_bytes", "share")


@dataclass(frozen=True)
class TierQuota:
    """One tenant's quota in one tier: a hard cap in bytes, or a guaranteed share of the tier."""

    cap_bytes: Optional[int] = None
    share: Optional[float] = None


@dataclass(frozen=True)
class Tenants:
    """The configured tenants and their quotas per tier name."""

    quotas: dict[str, dict[str, TierQuota]]

    @property
    def names(self) -> tuple[str, ...]:
        """The configured tenants, in config order."""
        return tuple(self.quotas)

    def labels(self) -> tuple[str, ...]:
        """Every label a counter may carry: the configured tenants, then ``OTHER``."""
        return (*self.quotas, OTHER)

    def label(self, tenant: Optional[str]) -> str:
        """The label of a put's tenant: its own name if configured, else ``OTHER``."""
        return tenant if tenant is not None and tenant in self.quotas else OTHER

    def of_tier(self, tier: str) -> dict[str, TierQuota]:
        """tenant -> its quota in ``tier`` (tenants with none there are absent)."""
        return {t: q[tier] for t, q in self.quotas.items() if tier in q}


def parse_tenants(raw: Any, tier_names: Collection[str], managed: Collection[str]) -> Tenants:
    """Check the ``"tenants"`` config; ``ConfigError`` naming the first problem.

    ``tier_names``: every tier of the store; ``managed``: those whose space the store manages (a quota on
    a shared pool is refused: the pool evicts by its own rules)."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"config key 'tenants': expected a mapping of tenant name -> quotas per tier, "
                          f"got {short(raw)}")
    quotas: dict[str, dict[str, TierQuota]] = {}
    shares: dict[str, float] = {}
    for name, per_tier in raw.items():
        name = check_str(name, "tenants: a tenant name")
        if name == OTHER:
            raise ConfigError(f"tenants: the name {OTHER!r} is reserved for chunks of unconfigured tenants")
        where = f"tenants.{name}"
        if not isinstance(per_tier, dict) or not per_tier:
            raise ConfigError(f"{where}: expected a mapping of tier name -> quota, got {short(per_tier)}")
        quotas[name] = {}
        for tier, q in per_tier.items():
            if tier not in tier_names:
                raise ConfigError(f"{where}: unknown tier {short(tier)}; tiers: {sorted(tier_names)}")
            if tier not in managed:
                raise ConfigError(f"{where}: tier {tier!r} is a shared pool that evicts by its own rules; "
                                  "quotas apply to managed tiers")
            quotas[name][tier] = _parse_quota(q, f"{where}.{tier}")
            share = quotas[name][tier].share
            if share is not None:
                shares[tier] = shares.get(tier, 0.0) + share
    for tier, total in shares.items():
        if total > 1.0 + 1e-9:
            raise ConfigError(f"tenants: the shares of tier {tier!r} sum to {total:g}, more than 1")
    return Tenants(quotas)


def _parse_quota(q: Any, where: str) -> TierQuota:
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: expected {{'cap_bytes': size}} or {{'share': fraction}}, got {short(q)}")
    unknown = sorted(set(q) - set(_QUOTA_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {list(_QUOTA_KEYS)}")
    if len(q) != 1:
        raise ConfigError(f"{where}: give exactly one of 'cap_bytes' or 'share'")
    if "cap_bytes" in q:
        return TierQuota(cap_bytes=parse_size(q["cap_bytes"], f"{where}.cap_bytes"))
    share = check_float(q["share"], f"{where}.share", min_value=0.0, max_value=1.0, min_exclusive=True)
    return TierQuota(share=share)


class TenantLedger:
    """Per-tenant usage of one managed tier, and the quota rules over it (see the module docstring).

    The caller (the level, under the store's lock) ``charge``-s a chunk's footprint to its tenant
    when it reserves the chunk and ``credit``-s it when the chunk's space is freed; ``victim_ok``
    decides, victim by victim, whether a put may take a chunk of another tenant.
    """

    __slots__ = ("_of", "capacity", "caps", "guaranteed", "hits", "tier", "usage")

    def __init__(self, tier: str, capacity: int, tenants: Tenants) -> None:
        self.tier = tier
        self.capacity = capacity
        mine = tenants.of_tier(tier)
        #: tenant -> cap in footprint bytes
        self.caps = {t: q.cap_bytes for t, q in mine.items() if q.cap_bytes is not None}
        #: tenant -> guaranteed footprint bytes (its share of the capacity, rounded down)
        self.guaranteed = {t: int(q.share * capacity) for t, q in mine.items() if q.share is not None}
        #: label -> footprint bytes its chunks take here (reserved or ready); every label present
        self.usage: dict[str, int] = dict.fromkeys(tenants.labels(), 0)
        #: label -> reads served from this tier
        self.hits: dict[str, int] = dict.fromkeys(tenants.labels(), 0)
        #: key -> label of each chunk the tier holds (absent: ``OTHER``)
        self._of: dict[str, str] = {}

    def charged(self, key: str) -> Optional[str]:
        """The configured tenant ``key`` is charged to here (None: ``OTHER``'s, or not held)."""
        return self._of.get(key)

    def charge(self, key: str, label: str, footprint: int) -> None:
        """``key`` (``label``'s) now takes ``footprint`` bytes here."""
        if label != OTHER:
            self._of[key] = label
        self.usage[label] += footprint

    def credit(self, key: str, footprint: int) -> None:
        """``key``'s ``footprint`` bytes here are free again."""
        self.usage[self._of.pop(key, OTHER)] -= footprint

    def count_hits(self, keys: Iterable[str]) -> None:
        """Reads served from this tier, per label."""
        of, hits = self._of, self.hits
        for key in keys:
            hits[of.get(key, OTHER)] += 1

    def over_cap(self, label: str, footprint: int) -> int:
        """Bytes ``label`` must free of its own here before a chunk of ``footprint`` fits its cap (0: fits)."""
        cap = self.caps.get(label)
        return 0 if cap is None else max(0, self.usage[label] + footprint - cap)

    def exceeds_cap(self, label: str, footprint: int) -> bool:
        """A chunk of ``footprint`` is larger than ``label``'s whole cap here."""
        cap = self.caps.get(label)
        return cap is not None and footprint > cap

    def victim_ok(self, key: str, putter: str, taken: dict[str, int], footprint: int, own_only: bool) -> bool:
        """Whether a put by ``putter`` may evict ``key`` (``footprint`` bytes), given what it already took
        per label in ``taken`` (updated when the answer is yes).  ``own_only``: the put is over its cap,
        so only its own chunks go."""
        label = self._of.get(key, OTHER)
        if label != putter:
            if own_only:
                return False
            floor = self.guaranteed.get(label)
            if floor is not None and self.usage[label] - taken.get(label, 0) - footprint < floor:
                return False
        taken[label] = taken.get(label, 0) + footprint
        return True

    def guard(self, pinned: Container[str], putter: str, own_only: bool) -> QuotaGuard:
        """What a policy must not name for a put by ``putter`` (its ``protected``); see ``QuotaGuard``."""
        return QuotaGuard(self, pinned, putter, own_only)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """label -> {used_bytes, hits, cap_bytes, guaranteed_bytes} (None where not configured)."""
        return {label: {"used_bytes": used, "hits": self.hits[label], "cap_bytes": self.caps.get(label),
                        "guaranteed_bytes": self.guaranteed.get(label)}
                for label, used in self.usage.items()}


class QuotaGuard:
    """The ``protected`` container a policy is given for a put under quotas: the pinned keys, the keys
    already considered (``seen``), and, unless they are the putter's own, the chunks of a tenant at or
    under its guaranteed bytes (or, when the put is over its cap, every other tenant's chunks).

    A cheap first filter (a policy asks ``key in protected`` as it walks its order); the level then checks
    each key the policy names with ``TenantLedger.victim_ok``, which counts what the put already took."""

    __slots__ = ("ledger", "own_only", "pinned", "putter", "seen", "taken")

    def __init__(self, ledger: TenantLedger, pinned: Container[str], putter: str, own_only: bool) -> None:
        self.ledger = ledger
        self.pinned = pinned
        self.putter = putter
        self.own_only = own_only
        self.seen: set[str] = set()
        #: label -> footprint bytes this put already took of it
        self.taken: dict[str, int] = {}

    def __contains__(self, key: object) -> bool:
        if key in self.pinned or key in self.seen:
            return True
        ledger = self.ledger
        label = ledger._of.get(key, OTHER) if isinstance(key, str) else OTHER
        if label == self.putter:
            return False
        if self.own_only:
            return True
        floor = ledger.guaranteed.get(label)
        return floor is not None and ledger.usage[label] - self.taken.get(label, 0) <= floor
