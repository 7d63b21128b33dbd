"""The one interface every storage medium implements.

A ``Tier`` is a flat namespace of immutable byte objects, addressed by key.  It is
small on purpose: it knows nothing of other tiers, policies or the chain; the
store alone decides what goes where.

Buffer ownership (the rule for every method, every medium):
    The caller owns every buffer it passes.  Each object is given as a list of
    *parts* (1-D contiguous ``torch.uint8`` tensors, on any device) whose
    concatenation is the object.  ``write`` has finished reading the source parts
    when it returns; ``read`` has finished filling the destination parts when it
    returns.  A tier never keeps a reference to a caller's buffer.

Capacity:
    For a *managed* tier (``managed = True``) the store does the accounting: it
    reserves ``footprint(nbytes)`` of ``capacity_bytes`` before it writes, and
    guarantees the sum of footprints of live objects never exceeds
    ``capacity_bytes``.  The tier in turn guarantees that any set of objects whose
    footprints fit in ``capacity_bytes`` can be written (no fragmentation failure).
    An *unmanaged* tier (a pool shared with other processes, such as a
    distributed store) manages its own space, may lose objects at any time, and is
    asked about presence directly.

Failures:
    ``write`` and ``read`` return one bool per key.  ``False`` from ``read`` means a
    miss: absent, short, corrupt or unreachable; the destination bytes are then
    unspecified and the store will not hand them out.  ``read`` never returns
    ``True`` for bytes that differ from what was written.  Exceptions are for
    misuse only.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from tierkv.errors import ConfigError, StoreClosedError
from tierkv.units import parse_size

Parts = list[torch.Tensor]


class Tier:
    """Base class of storage media.  Subclasses implement the ``_impl`` hooks' public twins."""

    #: name used in configs (``{"medium": "dram"}``)
    medium: ClassVar[str] = ""
    #: True when the store accounts for and evicts from this tier's capacity
    managed: ClassVar[bool] = True
    #: True when objects survive the process (the store rebuilds its index from ``recover()``)
    persistent: ClassVar[bool] = False

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"tier {name!r}: capacity must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self._closed = False
        self._lock = threading.Lock()

    # -- construction -------------------------------------------------------
    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "Tier":
        """Build from a tier config's medium-specific options (``capacity`` among them).

        Subclasses pop the options they know, then call ``reject_unknown``; an
        option left over is an error, so a typo in a config never goes unnoticed.
        """
        capacity = cls.pop_capacity(name, options)
        cls.reject_unknown(name, options)
        return cls(name, capacity)

    @classmethod
    def pop_capacity(cls, name: str, options: dict[str, Any], default: Any = None) -> int:
        raw = options.pop("capacity", default)
        if raw is None:
            raise ConfigError(f"tier {name!r} ({cls.medium}): 'capacity' is required (e.g. \"capacity\": \"2GiB\")")
        return parse_size(raw, f"tier {name!r} capacity")

    @classmethod
    def reject_unknown(cls, name: str, options: dict[str, Any]) -> None:
        if options:
            raise ConfigError(f"tier {name!r} ({cls.medium}): unknown option(s) {sorted(options)}")

    # -- the interface --------------------------------------------------------
    def footprint(self, nbytes: int) -> int:
        """Bytes of ``capacity_bytes`` an object of ``nbytes`` consumes here."""
        return nbytes

    def write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        """Store each ``srcs[i]`` under ``keys[i]``; True where it is now stored."""
        raise NotImplementedError

    def read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        """Fill each ``dsts[i]`` with the object ``keys[i]``; True where it was exact."""
        raise NotImplementedError

    def delete(self, keys: Sequence[str]) -> None:
        """Forget the objects (absent keys are ignored)."""
        raise NotImplementedError

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are stored (no side effect on recency or leases)."""
        raise NotImplementedError

    def recover(self) -> list[tuple[str, int]]:
        """(key, nbytes) of objects left by an earlier process (persistent media)."""
        return []

    def flush(self) -> None:
        """Make everything written so far durable (persistent media)."""

    @property
    def used_bytes(self) -> int:
        """Bytes this medium really holds now (≤ the store's accounted footprint)."""
        return 0

    @property
    def available(self) -> bool:
        """False while the medium cannot serve (backend down); the store then skips it."""
        return not self._closed

    def extra_stats(self) -> dict[str, Any]:
        """Medium-specific counters merged into ``stats()``."""
        return {}

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"tier {self.name!r} is closed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity_bytes={self.capacity_bytes})"
