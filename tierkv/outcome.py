"""What ``TieredStore.put_detailed`` answers for each chunk."""

from __future__ import annotations

import enum


class PutOutcome(enum.Enum):
    """Why ``put`` answered what it did for one chunk; true for STORED and PRESENT."""

    STORED = "stored"  #: written now
    PRESENT = "present"  #: already stored (or being stored): nothing written
    REJECTED = "rejected"  #: every tier's admission policy refused it
    NO_ROOM = "no_room"  #: admitted, but no room could be made
    ERROR = "error"  #: a medium failed the write, or every tier that would take it is unavailable

    def __bool__(self) -> bool:
        return self is PutOutcome.STORED or self is PutOutcome.PRESENT
