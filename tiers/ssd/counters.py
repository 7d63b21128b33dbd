"""``SSDCounters``: the events one SSD tier counts, one typed attribute each.

Each counter is an event the tier refused, dropped, repaired or did; ``extra_stats()`` exports them under
their attribute names (``as_dict``: the only place they are strings; ``docs/ssd.md`` lists them).

Ownership: the counters are the tier's (``SSDTier`` makes one ``SSDCounters`` and hands it to the
components that count); a component adds to the counter of an event it saw and never resets one
(``torn_regions`` alone is set, once, by the open).  Additions are made under the engine's ``lock``
(``EngineLocks.lock``, ``state.py``), so a snapshot (``as_dict``) taken under that lock is consistent.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class SSDCounters:
    """One SSD tier's event counters (see the module docstring), all 0 at first."""

    io_errors: int = 0  #: I/O errors other than a lack of room (logged, never raised)
    corrupt: int = 0  #: records found damaged (dropped)
    enospc: int = 0  #: writes refused for lack of room (the tier's, or the file system's)
    too_large: int = 0  #: objects larger than the whole tier, refused
    bad_key: int = 0  #: keys the format cannot hold, refused
    collisions: int = 0  #: reads that found another key of the same digest (a miss)
    rereads: int = 0  #: reads made again because the record moved while being read
    gc_runs: int = 0  #: reclamations run
    gc_relocated: int = 0  #: objects a reclamation moved
    gc_dropped: int = 0  #: objects a reclamation could not move (dropped)
    gc_disk_full: int = 0  #: reclamations run in place because the file system was full
    gc_in_place: int = 0  #: regions compacted within their own file
    checkpoints: int = 0  #: checkpoints written
    checkpoint_errors: int = 0  #: checkpoints that failed
    torn_regions: int = 0  #: regions found torn at open
    skipped_files: int = 0  #: files in the directory the tier could not interpret (left alone)
    partial_files_removed: int = 0  #: region files never begun, removed at open
    dir_removed: int = 0  #: files found removed behind the tier's back
    objects_lost: int = 0  #: chunks a user stored that the tier lost (a large object once)
    lock_lost: int = 0  #: times another process took the directory
    trimmed: int = 0  #: chunks dropped at open to fit a smaller capacity
    direct_writes: int = 0  #: records written straight to their file, past the image
    summaries_rebuilt: int = 0  #: region summaries written again
    regions_removed: int = 0  #: region files removed beyond what the capacity provisions
    not_writable: int = 0  #: writes refused while the tier could not write

    @staticmethod
    def names() -> tuple[str, ...]:
        """The counters' names, in export order."""
        return _NAMES

    def as_dict(self) -> dict[str, int]:
        """The counters by name, as ``extra_stats`` exports them.  Caller holds the engine's ``lock`` for a
        consistent snapshot."""
        return {name: getattr(self, name) for name in _NAMES}


_NAMES = tuple(f.name for f in fields(SSDCounters))
