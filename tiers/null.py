"""``null``: a payload-free medium that accounts bytes and keeps none.

The simulator (``tierkv.tools.sim``) swaps every configured medium for this one at
the same capacity and footprint rule, so the real ``TieredStore`` — its index,
eviction, admission, promotion and demotion — runs over a trace without moving
or holding a byte.  A ``read`` of a stored object reports True and leaves the
destination untouched: only use it where the bytes do not matter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from tierkv.errors import ConfigError
from tierkv.options import pop_choice, pop_int

from .base import Locality, Parts, Tier
from .slab import align_up

LOCALITIES = tuple(m.value for m in Locality)


class NullTier(Tier):
    """Objects as (key -> nbytes) entries; ``footprint`` is a given rule (default: ``nbytes``)."""

    medium = "null"
    keeps_bytes = False

    def __init__(self, name: str, capacity_bytes: int, footprint: Optional[Callable[[int], int]] = None,
                 locality: str = Locality.HOST, persistent: bool = False) -> None:
        super().__init__(name, capacity_bytes)
        if locality not in LOCALITIES:
            raise ConfigError(f"tier {name!r} (null): locality must be one of {LOCALITIES}, got {locality!r}")
        self.locality = Locality(locality)  # type: ignore[misc]  # shadows the class attribute: a null tier stands in for any medium
        self.persistent = persistent  # type: ignore[misc]  # (likewise)
        self._footprint = footprint
        self._fp_cache: dict[int, int] = {}
        self._objects: dict[str, int] = {}
        self._used = 0

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "NullTier":
        capacity = cls.pop_capacity(name, options)
        what = f"tier {name!r} (null)"
        locality = pop_choice(options, "locality", "host", what, LOCALITIES)
        align = pop_int(options, "align", 1, what, min_value=1)
        cls.reject_unknown(name, options)
        return cls(name, capacity, footprint=None if align == 1 else (lambda n: align_up(n, align)),
                   locality=locality)

    def footprint(self, nbytes: int) -> int:
        if self._footprint is None:
            return nbytes
        fp = self._fp_cache.get(nbytes)
        if fp is None:
            fp = self._fp_cache[nbytes] = int(self._footprint(nbytes))
        return fp

    def _write(self, keys: list[str], srcs: list[Parts]) -> list[bool]:
        objs = self._objects
        for key, parts in zip(keys, srcs):
            n = parts[0].numel() if len(parts) == 1 else sum(p.numel() for p in parts)
            self._used += n - objs.get(key, 0)
            objs[key] = n
        return [True] * len(keys)

    def _read(self, keys: list[str], dsts: list[Parts]) -> list[bool]:
        objs = self._objects
        out = []
        for key, parts in zip(keys, dsts):
            n = objs.get(key)
            out.append(n is not None and n == (parts[0].numel() if len(parts) == 1
                                               else sum(p.numel() for p in parts)))
        return out

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            n = self._objects.pop(key, None)
            if n is not None:
                self._used -= n

    def _contains(self, keys: list[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    @property
    def used_bytes(self) -> int:
        return self._used

    def extra_stats(self) -> dict[str, Any]:
        return {"objects": len(self._objects)}
