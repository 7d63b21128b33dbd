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

Located tiers (``located = True``, the slab under ``hbm`` and ``dram``):
    A managed tier may leave each object's location to its level, so the two do
    not each keep a per-object entry.  The level reserves by ``allocate`` (a
    location *code* per object, taken from the tier's space at once), writes and
    reads by ``write_at`` / ``read_at`` and gives space back by ``free_at``; the
    tier keeps no entry per object and the level's index holds the code.  A code
    is a positive ``int``: ``X << CODE_SHIFT | f << 1 | 1``, where ``f`` is the
    object's nbytes when below ``NB_FIELD`` and ``NB_FIELD`` otherwise (then
    ``code_nbytes`` tells it); ``X`` is the tier's own.  The level's index is the
    code's keeper; ``CODE_SHIFT`` and ``NB_FIELD``, the layout both sides read, are
    a contract (``tierkv.location_code``), and a located tier builds its codes from them.  The key-based methods
    still work on a tier nobody attached; once a level ``attach``-es it, ``read``
    and ``contains`` look keys up through the level, and ``write`` / ``delete`` by
    key are refused (the level alone places objects there).

Failures:
    ``write`` and ``read`` return one bool per key.  ``False`` from ``read`` means a
    miss: absent, short, corrupt or unreachable; the destination bytes are then
    unspecified and the store will not hand them out.  ``read`` never returns
    ``True`` for bytes that differ from what was written; a medium that can tell
    a copy is present but not the bytes stored (a failed checksum, a wrong size)
    answers ``CORRUPT`` (falsy) for it, and the store counts it ``corrupt`` and
    drops it.  Exceptions are for misuse only.

Checksums (``tierkv.checksum``):
    Each chunk's sum is computed once, when a put brings its bytes in, and
    travels with it.  A tier that verifies its own reads against a sum it
    stores with each object, the same value (``verifies_reads``, the ``ssd``
    tier's records), is trusted with it; a pool shared with other processes
    (``sum_inside``) is handed each object with the sum in a trailer after the
    chunk's bytes, which the store checks on every read.  For any other medium
    the level keeps the sum beside the chunk and checks reads when its
    ``verify`` option says so.  A medium that copies the bytes itself may sum
    them as it copies (``sums_copies``): ``read`` is then handed a ``ReadSums``
    and answers each object's sum with it, so the check needs no second pass
    over the bytes.  A medium only declares these; the store reconciles them
    with a level's ``verify`` in one place (``tierkv.engine.integrity.select``,
    which picks the level's one integrity strategy) and nowhere else.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import torch

from tierkv.checksum import ReadSums
from tierkv.enums import StrEnum
from tierkv.errors import ConfigError, StoreClosedError
from tierkv.location_code import NB_FIELD
from tierkv.units import parse_size

Parts = list[torch.Tensor]

_STR = {str}
_LISTS = {list, tuple}


class _Corrupt(enum.Enum):
    """``CORRUPT``: a read's answer for a copy that is present but not the bytes stored (falsy)."""

    CORRUPT = "corrupt"

    def __bool__(self) -> bool:
        return False


#: what ``read`` answers for a copy present but not the bytes stored (falsy; see "Failures")
CORRUPT = _Corrupt.CORRUPT


class Locality(StrEnum):
    """Where a tier's bytes live, as the engine sees it (``Tier.locality``); the values are the words stats print."""

    DEVICE = "device"  #: this device's memory
    HOST = "host"  #: this host's DRAM
    REMOTE = "remote"  #: another node, or a pool shared over the network
    DISK = "disk"  #: local files


class Tier:
    """Base class of storage media.  Subclasses implement ``_write`` / ``_read`` / ``_delete`` / ``_contains``."""

    #: name used in configs (``{"medium": "dram"}``)
    medium: ClassVar[str] = ""
    #: True when the store accounts for and evicts from this tier's capacity
    managed: ClassVar[bool] = True
    #: True when objects survive the process (the store rebuilds its index from ``recover_columns()``)
    persistent: ClassVar[bool] = False
    #: where the bytes live, as the engine sees it: a ``Locality`` (``device``, ``host``, ``remote``,
    #: ``disk``); a subclass that declares it as a string has it checked and turned into a member
    locality: ClassVar[Locality] = Locality.HOST
    #: False for a payload-free medium (the simulator's): it accounts bytes but holds none
    keeps_bytes: ClassVar[bool] = True
    #: True when the tier can leave each object's location to its level (see "Located tiers")
    located: ClassVar[bool] = False
    #: True when the medium stores each object's checksum with it and checks it on every read, the same
    #: value as ``tierkv.checksum.chunk_sum`` (see "Checksums")
    verifies_reads: ClassVar[bool] = False
    #: True when the store keeps each chunk's checksum inside the object, in a trailer after its bytes
    #: (a pool other processes read and write; see "Checksums")
    sum_inside: ClassVar[bool] = False
    #: True when ``read`` can sum the bytes it copies as it copies them (its ``sums``; see "Checksums")
    sums_copies: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("locality")
        if declared is not None and not isinstance(declared, Locality):
            if type(declared) is not str or declared not in Locality._value2member_map_:
                raise ConfigError(f"medium class {cls.__name__}: locality must be one of "
                                  f"{[m.value for m in Locality]}, got {declared!r}")
            cls.locality = Locality(declared)

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
    # Non-virtual: the public methods check the contract (open, keys a sequence of
    # strings, one buffer list per key) and then call the medium's ``_write`` /
    # ``_read`` / ``_delete`` / ``_contains``, so no medium can skip the checks.
    def footprint(self, nbytes: int) -> int:
        """Bytes of ``capacity_bytes`` an object of ``nbytes`` consumes here: a function of ``nbytes`` alone
        (the store may remember it per size)."""
        return nbytes

    def write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        """Store each ``srcs[i]`` under ``keys[i]``; True where it is now stored."""
        keys, srcs = self._check_batch(keys, srcs, "srcs")
        return self._check_results(self._write(keys, srcs), len(keys), "write")

    def read(self, keys: Sequence[str], dsts: Sequence[Parts], sums: Optional[ReadSums] = None) -> list[bool]:
        """Fill each ``dsts[i]`` with the object ``keys[i]``; True where it was exact.

        ``sums``: a request to sum what is copied (one ``nbytes`` per key), answered by a
        medium that ``sums_copies`` and left all None by any other."""
        keys, dsts = self._check_batch(keys, dsts, "dsts")
        if sums is None or not self.sums_copies:
            return self._check_results(self._read(keys, dsts), len(keys), "read")
        if len(sums.nbytes) != len(keys):
            raise ValueError(f"tier {self.name!r}: {len(keys)} keys but {len(sums.nbytes)} sums asked for")
        return self._check_results(self._read_summed(keys, dsts, sums), len(keys), "read")

    def delete(self, keys: Sequence[str]) -> None:
        """Forget the objects (absent keys are ignored)."""
        keys = self._check_keys(keys)
        self._delete(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are stored (no side effect on recency or leases)."""
        keys = self._check_keys(keys)
        return self._check_results(self._contains(keys), len(keys), "contains")

    # -- what a medium implements -------------------------------------------
    def _write(self, keys: list[str], srcs: list[Parts]) -> list[bool]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _write")

    def _read(self, keys: list[str], dsts: list[Parts]) -> list[bool]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _read")

    def _read_summed(self, keys: list[str], dsts: list[Parts], sums: ReadSums) -> list[bool]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _read_summed")

    def _delete(self, keys: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _delete")

    def _contains(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _contains")

    # -- contract checks ----------------------------------------------------
    def _check_keys(self, keys: Sequence[str]) -> list[str]:
        self._check_open()
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TypeError(f"tier {self.name!r}: keys must be a sequence of strings (a list), "
                            f"got {type(keys).__name__}")
        keys = list(keys)
        if keys and set(map(type, keys)) != _STR:  # (one C pass for the common case)
            for k in keys:
                if not isinstance(k, str):
                    raise TypeError(f"tier {self.name!r}: keys must be strings, got {type(k).__name__}")
        return keys

    def _check_batch(self, keys: Sequence[str], bufs: Sequence[Parts], what: str) -> tuple[list[str], list[Parts]]:
        keys = self._check_keys(keys)
        if isinstance(bufs, torch.Tensor) or not isinstance(bufs, Sequence):
            raise TypeError(f"tier {self.name!r}: {what} must be a sequence with one list of parts per key")
        bufs = list(bufs)
        if len(keys) != len(bufs):
            raise ValueError(f"tier {self.name!r}: {len(keys)} keys but {len(bufs)} {what}")
        if bufs and not set(map(type, bufs)) <= _LISTS:
            for i, parts in enumerate(bufs):
                if isinstance(parts, torch.Tensor) or not isinstance(parts, (list, tuple)):
                    raise TypeError(f"tier {self.name!r}: {what}[{i}] must be a list of uint8 tensors")
        return keys, bufs

    def _check_results(self, oks: Any, n: int, op: str) -> Any:
        if len(oks) != n:
            raise RuntimeError(f"tier {self.name!r} {op} answered {len(oks)} results for {n} keys")
        return oks

    # -- located tiers (see the module docstring) -----------------------------
    def attach(self, resolve: Any) -> None:
        """A level takes over the index: ``resolve(keys)`` gives the READY code of each key (None if absent)."""
        raise NotImplementedError(f"{type(self).__name__} is not a located tier")

    def allocate(self, sizes: Sequence[int]) -> list[Any]:
        """A code for an object of each size, its space taken now (None where none is free; what a None could
        not place takes nothing).  Sizes are ints >= 0 (``TypeError`` / ``ValueError`` otherwise)."""
        raise NotImplementedError(f"{type(self).__name__} is not a located tier")

    def write_at(self, codes: Sequence[int], srcs: Sequence[Parts], ptrs: Optional[Sequence[int]] = None) -> None:
        """Copy each ``srcs[i]`` into the space of ``codes[i]`` (a code from ``allocate``, not yet freed).

        ``ptrs``, when given, vouches for every ``srcs[i]``: one contiguous host part of exactly
        ``code_nbytes(codes[i])`` bytes, whose address is ``ptrs[i]``; a tier may then skip its
        own per-part checks.  The store passes it only for buffers it checked itself.
        """
        raise NotImplementedError(f"{type(self).__name__} is not a located tier")

    def read_at(self, codes: Sequence[int], dsts: Sequence[Parts], ptrs: Optional[Sequence[int]] = None,
                sums: Optional[ReadSums] = None) -> list[bool]:
        """Fill each ``dsts[i]`` from the space of ``codes[i]``; False where the sizes differ
        (``ptrs`` as for ``write_at``; ``sums`` as for ``read``)."""
        raise NotImplementedError(f"{type(self).__name__} is not a located tier")

    def free_at(self, codes: Sequence[int]) -> None:
        """Give back the space of each code (a no-op on a closed tier).  A code that is not live raises
        ``ValueError`` here and in every located call, as far as the tier can tell (all are checked before any
        is freed); ``ptrs`` callers vouch for their codes (tests/test_located_conformance.py)."""
        raise NotImplementedError(f"{type(self).__name__} is not a located tier")

    def views_at(self, codes: Sequence[int]) -> Optional[list[Parts]]:
        """Host views of each object's own bytes (its parts), valid while the caller holds the codes (pinned);
        None where the tier has none to give (device memory, or a tier that only copies).  The store hands
        them to a persistent tier below instead of a staged copy; nobody writes through them."""
        return None

    def code_nbytes(self, code: int) -> int:
        """nbytes of the object a code locates."""
        f = code >> 1 & NB_FIELD
        if f != NB_FIELD:
            return f
        raise NotImplementedError(f"{type(self).__name__} is not a located tier")

    def recover(self) -> list[tuple[str, int]]:
        """(key, nbytes) of objects left by an earlier process (persistent media)."""
        return []

    def recover_columns(self) -> tuple[list[str], Any]:
        """``recover`` as two columns: the keys (a list) and their nbytes (a sequence or an int array), oldest
        first.  A medium that holds them as arrays hands them over as they are (the store loads its index
        from them in bulk); the default splits ``recover()``."""
        found = self.recover()
        if not found:
            return [], []
        keys, sizes = zip(*found)
        return list(keys), sizes

    def flush(self) -> None:
        """Make everything written so far durable (persistent media).  A medium that could not raises
        ``tierkv.durability.TierFlushError`` (the store reports it, never raises it)."""

    @property
    def objects_lost(self) -> int:
        """Acknowledged objects this medium lost on its own since it opened (its files removed behind it,
        damage): when it rises, the store forgets the keys the medium no longer holds.  0 for media that
        never lose what they took."""
        return 0

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
