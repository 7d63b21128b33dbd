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
far the model is from the store.  Cost: one string hash per key per batch (cached by Python on the key), and
policy bookkeeping for the sampled ``rate`` of keys in each shadow.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Optional, cast

import xxhash

from tierkv.errors import ConfigError
from tierkv.options import check_float


def _xxh(key: str) -> int:
    """A key's sampling hash: ``_xxh(key) & _MASK < threshold`` puts it in the sample, the same way in every process.

    xxh3 of the key: a stable spatial hash, so an estimate is reproducible run to
    run and agrees with ``tierkv simulate`` on the same trace (Python's own string
    hash is seeded per process, so the sample, and the estimate, would change with it).
    """
    return xxhash.xxh3_64_intdigest(key.encode())


_SCALE = 1 << 24
_MASK = _SCALE - 1
DEFAULT_FACTORS = (0.5, 1.0, 2.0, 4.0)


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
        self.requests = 0  # sampled chunk requests
        self.demand = 0  # all chunk requests
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
            demand = len(keys)
            t = self._threshold  # (inline: this runs for every key of every batch)
            picks = [(k, n) for k, n in zip(keys, cast("list[int]", sizes)) if _xxh(k) & _MASK < t]  # (given for puts)
        elif op == "get":
            demand = sum(result)
            t = self._threshold
            picks = [(k, n) for k, n, ok in zip(keys, cast("list[int]", sizes), result) if ok and _xxh(k) & _MASK < t]
        else:
            return
        with self._lock:
            self.demand += demand
            if not picks:
                return
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
            # SHARDS-adj: the sample holds more or fewer requests than rate x all; the difference
            # is mostly repeats of hot keys, so it is counted as hits at every size
            expected = self.rate * self.demand
            adjust = expected - self.requests
            for name, shadows in self._tiers:
                per: dict[str, Any] = {}
                for f, sh in shadows.items():
                    cum = min(1.0, max(0.0, (sh.hits + adjust) / expected)) if expected >= 1 else 0.0
                    per[f"{f:g}"] = {"capacity_bytes": int(f * self._caps[name]), "cumulative_hit_rate": cum,
                                     "hit_rate": max(0.0, cum - above_rate), "sampled_chunks": len(sh.sizes)}
                out[name] = {"sample_rate": self.rate, "sampled_requests": self.requests, "requests": self.demand,
                             "factors": per}
                above_rate = per["1"]["cumulative_hit_rate"]
        return out

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        return {name: {"shadow": est} for name, est in self.estimates().items()}


def attach(store: Any, rate: float = 0.05, factors: Sequence[float] = DEFAULT_FACTORS) -> ShadowObserver:
    """Start shadowing ``store``'s tiers; estimates appear in ``stats()["tiers"][name]["shadow"]``."""
    obs = ShadowObserver(store, rate=rate, factors=factors)
    store.add_observer(obs)
    return obs
