"""Typed answers: what ``TieredStore.put_detailed`` answers for each chunk, what an admission policy answers,
and why a chunk a lookup asked for was not there (``MissReason``).

``PutOutcome`` and ``Admission`` are enums whose values are the words stats and logs print; both are true
only for the yes (``PutOutcome.STORED`` / ``PRESENT``, ``Admission.ADMIT``), so a refusal or a throttled
answer is never mistaken for a success.  ``MissReason`` is a ``StrEnum`` (``tierkv.enums``): its members are
the words of ``stats()["total"]["misses_by_reason"]``, of the exporter's ``reason`` label and of traces.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from tierkv.enums import StrEnum


class PutOutcome(enum.Enum):
    """Why ``put`` answered what it did for one chunk; true for STORED and PRESENT."""

    STORED = "stored"  #: written now
    PRESENT = "present"  #: already stored (or being stored): nothing written
    REJECTED = "rejected"  #: every tier's admission policy refused it
    NO_ROOM = "no_room"  #: admitted, but no room could be made
    ERROR = "error"  #: a medium failed the write, or every tier that would take it is unavailable

    def __bool__(self) -> bool:
        return self is PutOutcome.STORED or self is PutOutcome.PRESENT


class MissReason(StrEnum):
    """Why a chunk was not served (``TieredStore.why_missing``); the label set of every miss counter.

    The answer comes from the store's bounded memory of recent departures (``miss_memory`` entries):
    a key older than the last ``miss_memory`` departures, or never seen, is ``NEVER_STORED``, which
    therefore reads "never stored, or not among the last N departures".
    """

    NEVER_STORED = "never_stored"  #: not in the memory: never stored here, or departed before the last N
    EVICTED = "evicted"  #: evicted from the last tier holding it (the memory names tier and policy)
    REJECTED = "rejected"  #: its put was refused by every tier (admission, or no room could be made)
    CORRUPT = "corrupt"  #: dropped because its bytes failed verification
    AUDIT_FAILED = "audit_failed"  #: dropped because a recompute audit found it differs from fresh KV
    LEASE_EXPIRED = "lease_expired"  #: a lease held from lookup to load ran out before the load
    UNAVAILABLE = "unavailable"  #: a tier that may hold it is marked unavailable (or its put failed so)
    OTHER_NAMESPACE = "other_namespace"  #: stored under another model / layout / TP / salt


class Admission(enum.Enum):
    """An admission policy's answer for one chunk and one tier; true for ADMIT alone.

    ``REJECT`` is a verdict on the chunk (it goes on to the next tier); ``THROTTLED`` says the tier would
    take it but not now (a rate or budget is spent): the chunk goes on too, and the answer is counted apart,
    so an operator can tell a policy that filters from one that cannot keep up.
    """

    ADMIT = "admit"
    REJECT = "reject"
    THROTTLED = "throttled"

    def __bool__(self) -> bool:
        return self is Admission.ADMIT


@dataclass
class AdmissionCounts:
    """How often a tier's admission answered each way: the one place those answers are counted.

    The store keeps one per tier and records every answer it acts on (``counts.record(answer)``); the
    answer comes back, so the call can stand where the answer is used.
    """

    admitted: int = 0
    rejected: int = 0
    throttled: int = 0

    def record(self, answer: Admission, n: int = 1) -> Admission:
        """Count ``n`` chunks answered ``answer``; returns ``answer``."""
        if answer is Admission.ADMIT:
            self.admitted += n
        elif answer is Admission.REJECT:
            self.rejected += n
        elif answer is Admission.THROTTLED:
            self.throttled += n
        else:
            raise TypeError(f"an admission answer is an Admission, got {answer!r}")
        return answer

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
