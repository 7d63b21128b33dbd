"""What one remote tier believes the shared pool holds: recent presence and pending removals.

The pool is shared with other processes and may lose objects at any time, so
this is a short-lived cache, never an index:

    * a key confirmed present (stored, read, or answered by an exists call)
      answers ``contains`` without a backend call for ``ttl`` seconds;
    * a deleted key the backend still holds (removal refused while readers hold a
      lease) is a *tombstone*: it reads as absent here until a removal succeeds;
    * ``clear()`` forgets everything; the tier calls it when its sentinel key
      shows the pool it knew is gone (a restarted master) or on a new client.

Thread safety: plain dict operations under the GIL; a racing update can only
make an entry older or newer, never claim a key nobody confirmed.
"""

from __future__ import annotations

import time


class Presence:
    """Recently confirmed keys (with sizes when known) and tombstones of deleted keys."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._present: dict[str, tuple[float, int]] = {}  # key -> (confirmed at, nbytes or -1)
        self.tombstones: dict[str, float] = {}  # deleted keys the backend still holds

    def remember(self, key: str, nbytes: int) -> None:
        """``key`` holds an object of ``nbytes`` (-1: size unknown), confirmed now."""
        if nbytes < 0:
            hit = self._present.get(key)
            nbytes = hit[1] if hit else -1
        self._present[key] = (time.monotonic(), nbytes)
        self.tombstones.pop(key, None)

    def known(self, key: str) -> bool:
        """Confirmed present within ``ttl`` seconds."""
        hit = self._present.get(key)
        return hit is not None and time.monotonic() - hit[0] < self.ttl

    def held(self, key: str) -> bool:
        """Remembered at all (however long ago): a write in this batch stored it."""
        return key in self._present

    def forget(self, key: str) -> None:
        self._present.pop(key, None)

    def bury(self, key: str) -> None:
        """``key`` was deleted; it reads absent until ``unbury`` (the backend confirmed the removal)."""
        self._present.pop(key, None)
        self.tombstones[key] = time.monotonic()

    def unbury(self, key: str) -> None:
        self.tombstones.pop(key, None)

    def buried(self, key: str) -> bool:
        return key in self.tombstones

    def clear(self) -> None:
        self._present.clear()
        self.tombstones.clear()

    @property
    def used_bytes(self) -> int:
        return sum(n for _, n in list(self._present.values()) if n > 0)
