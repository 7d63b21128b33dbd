"""Typed answers: what ``TieredStore.put_detailed`` answers for each chunk, and what an admission policy answers.

Both are enums whose values are the words stats and logs print; both are true only for the yes
(``PutOutcome.STORED`` / ``PRESENT``, ``Admission.ADMIT``), so a refusal or a throttled answer is never
mistaken for a success.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass


class PutOutcome(enum.Enum):
    """Why ``put`` answered what it did for one chunk; true for STORED and PRESENT."""

    STORED = "stored"  #: written now
    PRESENT = "present"  #: already stored (or being stored): nothing written
    REJECTED = "rejected"  #: every tier's admission policy refused it
    NO_ROOM = "no_room"  #: admitted, but no room could be made
    ERROR = "error"  #: a medium failed the write, or every tier that would take it is unavailable

    def __bool__(self) -> bool:
        return self is PutOutcome.STORED or self is PutOutcome.PRESENT


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
