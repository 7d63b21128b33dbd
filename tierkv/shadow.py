"""What more capacity would buy, live: sampled shadow caches per tier (spatial sampling, as in SHARDS).

A ``ShadowObserver`` watches the store's batches (``TieredStore.add_observer``)
and replays a *sample* of the chunk requests into small shadow caches: a key is
sampled when a hash of it falls below ``rate`` (so a key is always or never
sampled), and a shadow of capacity ``C`` is simulated at ``rate * C`` bytes.
Hit ratios of the sample estimate those of the full stream.

Demand model: a chunk request is a key read by a ``get`` that found it, or a
key given to ``put`` (a chunk the engine had to compute, or offers again).  A
get that missed is not counted: the engine puts that chunk next.

Tiers of an inclusive chain behave roughly like one cache of their summed
capacity, so the shadow of tier ``T`` at factor ``f`` is a cache of (capacity of
the managed tiers above ``T``) + ``f`` x (``T``'s capacity), run by a fresh
instance of ``T``'s eviction policy class:

* ``cumulative_hit_rate``: fraction of chunk requests served at or above ``T``;
* ``hit_rate``: the part of it served by ``T`` (the cumulative estimate minus the
  tiers above at their real size).

Factor 1 is simulated too: compare it with the tier's real counters to see how
far the model is from the store.  Cost: one 64-bit hash per key per batch, and
policy bookkeeping for the sampled ``rate`` of keys in each shadow.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Optional

import xxhash

from tierkv.errors import ConfigError
from tierkv.options import check_float

_SCALE = 1 << 24
DEFAULT_FACTORS = (0.5, 1.0, 2.0, 4.0)


def sampled(key: str, threshold: int) -> bool:
    return xxhash.xxh3_64_intdigest(key.encode()) % _SCALE < threshold


class ShadowCache:
    """A byte-capacity cache of keys only, run by one eviction policy instance."""

    def __init__(self, policy: Any, capacity_bytes: float) -> None:
        self.policy = policy
        self.capacity = max(1, int(capacity_bytes))
        policy.capacity_bytes = self.capacity
        self.sizes: dict[str, int] = {}
        self.used = 0
        self.hits = 0
        self.requests = 0

    def request(self, key: str, nbytes: int) -> bool:
        """One chunk request: a hit refreshes the key, a miss inserts it (evicting as the policy says)."""
        self.requests += 1
        if key in self.sizes:
            self.hits += 1
            self.policy.on_access(key)
            return True
        if nbytes > self.capacity:
            return False
        need = self.used + nbytes - self.capacity
        if need > 0:
            victims = self.policy.victims(need, ())
            if victims is None:
                return False
            for v in victims:
                n = self.sizes.pop(v, None)
                if n is not None:
                    self.used -= n
                    self.policy.on_remove(v)
            if self.used + nbytes > self.capacity:
                return False
        self.sizes[key] = nbytes
        self.used += nbytes
        self.policy.on_insert(key, nbytes)
        return False


def _fresh_policy(policy: Any) -> Any:
    try:
        return type(policy)()
    except TypeError as e:
        raise ConfigError(f"shadow: eviction policy {type(policy).__name__} cannot be built without arguments "
                          f"({e}); the shadow needs a fresh instance of the tier's policy class") from e


class ShadowObserver:
    """Shadow caches for every managed tier of a store, at ``factors`` x its capacity."""

    def __init__(self, store: Any, rate: float = 0.05, factors: Sequence[float] = DEFAULT_FACTORS) -> None:
        rate = check_float(rate, "shadow rate", min_value=0, max_value=1, min_exclusive=True)
        factors = sorted({check_float(f, "shadow factor", min_value=0, min_exclusive=True) for f in factors} | {1.0})
        self.rate = rate
        self.factors = factors
        self._threshold = max(1, int(rate * _SCALE))
        self._lock = threading.Lock()
        self.requests = 0
        self._tiers: list[tuple[str, dict[float, ShadowCache]]] = []
        above = 0
        for lvl in store.levels:
            if not lvl.managed or lvl.eviction is None:
                continue
            shadows = {f: ShadowCache(_fresh_policy(lvl.eviction), rate * (above + f * lvl.capacity))
                       for f in factors}
            self._tiers.append((lvl.name, shadows))
            above += lvl.capacity
        self._caps = {lvl.name: lvl.capacity for lvl in store.levels}

    def observe(self, op: str, keys: list[str], result: Any, seconds: float, sizes: Optional[list[int]]) -> None:
        if op == "put":
            picks = [(k, n) for k, n in zip(keys, sizes) if sampled(k, self._threshold)]
        elif op == "get":
            picks = [(k, n) for k, n, ok in zip(keys, sizes, result) if ok and sampled(k, self._threshold)]
        else:
            return
        if not picks:
            return
        with self._lock:
            self.requests += len(picks)
            for _, shadows in self._tiers:
                for sh in shadows.values():
                    for k, n in picks:
                        sh.request(k, n)

    def estimates(self) -> dict[str, dict[str, Any]]:
        """Per tier: sample rate, sampled requests and, per factor, capacity and hit-rate estimates."""
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            above_rate = 0.0
            for name, shadows in self._tiers:
                per: dict[str, Any] = {}
                for f, sh in shadows.items():
                    cum = sh.hits / sh.requests if sh.requests else 0.0
                    per[f"{f:g}"] = {"capacity_bytes": int(f * self._caps[name]), "cumulative_hit_rate": cum,
                                     "hit_rate": max(0.0, cum - above_rate)}
                out[name] = {"sample_rate": self.rate, "sampled_requests": self.requests, "factors": per}
                one = shadows[1.0]
                above_rate = one.hits / one.requests if one.requests else 0.0
        return out

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        return {name: {"shadow": est} for name, est in self.estimates().items()}


def attach(store: Any, rate: float = 0.05, factors: Sequence[float] = DEFAULT_FACTORS) -> ShadowObserver:
    """Start shadowing ``store``'s tiers; estimates appear in ``stats()["tiers"][name]["shadow"]``."""
    obs = ShadowObserver(store, rate=rate, factors=factors)
    store.add_observer(obs)
    return obs
