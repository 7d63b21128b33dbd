"""What the scheduler asks a worker, and what the worker answers: typed messages, one per question.

The store lives with the workers, so the scheduler's question about a request (how
far its prefix is stored) is answered by a worker (probe.py) and carried by the
lookup channel (lookup.py).  Every message is a frozen dataclass; a channel takes
one request type and nothing else, so a question the worker does not serve is an
error naming its type, never a string that matched nothing.

Channels
    ``lookup``: :class:`ProbeRequest` -> :class:`ProbeAnswer`.
    ``lifecycle``: :class:`ShutdownRequest` -> None (the worker drains and closes;
    the engine is going down).  Apart from lookups, so that a worker busy answering
    never delays it and a lookup client never sees it.

Block positions count from the request's first block; ``hashes[i]`` is vLLM's hash of
block ``i``.  Nothing here touches a store, a socket or an engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Channel(enum.Enum):
    """A worker's channels; each carries one request type (see :data:`REQUEST_TYPE`)."""

    LOOKUP = "lookup"
    LIFECYCLE = "lifecycle"


@dataclass(frozen=True)
class TierPlace:
    """Where a stored block is: the tier holding it and the tier's declared locality (tiers/base.py)."""

    tier: str
    locality: str | None


@dataclass(frozen=True)
class ProbeRequest:
    """A request's whole lookup: its block hashes from block 0, the blocks vLLM holds, its cache salt.

    ``local`` blocks (``0 .. local-1``) are in vLLM's own cache; the question is how
    far the store holds the prefix from there, and whether it holds those ``local``.
    """

    hashes: list[bytes]
    local: int
    salt: str | None = None
    #: the request asking: the worker leases what it reports for that request's load (see leases.py, with
    #: ``lease_timeout_s``), and counts the reasons of its misses once per request
    req_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.local, bool) or not isinstance(self.local, int) or self.local < 0:
            raise ValueError(f"ProbeRequest.local must be an int >= 0, got {self.local!r}")
        if self.req_id is not None and not isinstance(self.req_id, str):
            raise ValueError(f"ProbeRequest.req_id must be a string or None, got {type(self.req_id).__name__}")


@dataclass(frozen=True)
class ProbeAnswer:
    """The answer to a :class:`ProbeRequest`, from one pass over the store.

    ``reach``: blocks stored from ``local`` on, counted from there (every layer of
    this worker's KV-head shard holds them); ``held``: blocks of ``0 .. local-1``
    stored, counted from 0; ``where[i]``: where block ``local + i`` is (``reach``
    entries; None where the tier could not be told); ``leased``: objects of the reach
    this worker holds for the request's load (0 when the request named none, or
    leases are off); ``missed``: the blocks from ``local + reach`` on that the store
    does not serve, by reason (``tierkv.outcome.MissReason`` words; the counts add up
    to ``len(hashes) - local - reach``).
    """

    reach: int = 0
    held: int = 0
    where: list[TierPlace | None] = field(default_factory=list)
    leased: int = 0
    missed: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ShutdownRequest:
    """Drain queued saves and close the store now: the engine is going down (no answer is awaited)."""


#: the one request type each channel carries
REQUEST_TYPE: dict[Channel, type] = {Channel.LOOKUP: ProbeRequest, Channel.LIFECYCLE: ShutdownRequest}
