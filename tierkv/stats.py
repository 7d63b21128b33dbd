"""Counters kept per tier and for the whole store."""

from __future__ import annotations

from dataclasses import asdict, dataclass


# (each counter class below is a plain dataclass of int fields, its own: the classes, and the tool's own
# results such as ``tierkv.tools.sim.replay.SimResult``, are alike in shape only; there is no code to share)
@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    rejected: int = 0  # refused: admission said no, or no room could be made
    errors: int = 0  # failed or corrupt reads and writes
    corrupt: int = 0  # copies that failed their checksum (or a medium found corrupt): dropped, read as misses
    persisted: int = 0  # chunks copied in by the write-behind queue

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class PutCounters:
    """The put path's counters: owned and updated by ``Writer`` (lock held)."""

    put_calls: int = 0
    chunks_put: int = 0
    chunks_stored: int = 0  # newly stored by a put
    chunks_deduped: int = 0  # put of a chunk already present
    chunks_rejected: int = 0  # put that no tier took
    bytes_put: int = 0


@dataclass
class GetCounters:
    """The read path's counters: owned and updated by ``Reader`` (lock held)."""

    get_calls: int = 0
    lookup_calls: int = 0
    hits: int = 0
    misses: int = 0
    bytes_got: int = 0


@dataclass
class CopyCounters:
    """The background copies' counters: owned and updated by ``Copier`` (lock held)."""

    write_behind_queued: int = 0  # chunks handed to the write-behind queue
    promotions_dropped: int = 0  # promotions the background queue gave up (full, closing, failed)


@dataclass
class LeaseCounters:
    """The leases' counters: owned and updated by ``LeaseBook`` (lock held)."""

    leases: int = 0  # leases granted (TieredStore.lease)
    leased_chunks: int = 0  # chunks those leases pinned
    leases_released: int = 0  # leases their holder released
    lease_expired: int = 0  # leases their deadline released (the chunks could be evicted again)


@dataclass
class StoreCounters:
    """The store's counters as ``stats()["total"]`` and the metrics catalogue name them, in that order: a
    snapshot gathered from the parts that own them (``of``), never updated itself."""

    put_calls: int = 0
    get_calls: int = 0
    lookup_calls: int = 0
    chunks_put: int = 0
    chunks_stored: int = 0  # newly stored by a put
    chunks_deduped: int = 0  # put of a chunk already present
    chunks_rejected: int = 0  # put that no tier took
    hits: int = 0
    misses: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    write_behind_queued: int = 0  # chunks handed to the write-behind queue
    promotions_dropped: int = 0  # promotions the background queue gave up (full, closing, failed)
    leases: int = 0  # leases granted (TieredStore.lease)
    leased_chunks: int = 0  # chunks those leases pinned
    leases_released: int = 0  # leases their holder released
    lease_expired: int = 0  # leases their deadline released (the chunks could be evicted again)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def of(cls, *parts: PutCounters | GetCounters | CopyCounters | LeaseCounters) -> StoreCounters:
        """The snapshot of ``parts`` (each owner's counters; a field none of them has stays 0)."""
        return cls(**{k: v for part in parts for k, v in asdict(part).items()})
