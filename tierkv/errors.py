"""The errors tierkv raises.

Normal life (a miss, a full tier, a backend that is down, a checksum that does
not match) is never an exception: those are values (``False``, a short count)
and counters in ``stats()``.  Exceptions are for misuse, and their message names
the problem.
"""

from __future__ import annotations


class TierKVError(Exception):
    """Base class of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A configuration names an unknown medium or policy, or a bad value."""


class BufferSizeError(TierKVError, ValueError):
    """A caller's buffer does not match the size of the chunk it is meant for."""


class StoreClosedError(TierKVError, RuntimeError):
    """The store (or tier) was used after ``close()``."""


class PolicyError(TierKVError, RuntimeError):
    """A policy broke its contract (for example named a protected key as victim)."""
