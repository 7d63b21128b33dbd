"""Chunk checksums: one xxh3-64 per chunk, computed where its bytes enter the store.

The sum is xxh3-64 (seed 0) of the chunk's bytes, its parts in order: the value the
``ssd`` tier writes as a record's payload sum (``tiers/ssd/format.py``, an
uncompressed xxh3 record), so the same number stands for the chunk in every tier.
It is computed in C over each part's buffer (``tierkv.xxh3``: outside the interpreter
lock, a large batch on two threads), never byte by byte.

A medium that copies host memory itself can sum the bytes as it copies them
(``Tier.sums_copies``): a read handed a ``ReadSums`` gets each object's sum back
with it, hashed piece by piece right after each piece was copied, while it is still
in the cache, instead of a second pass over memory afterwards.

A pooled object (``Tier.sum_inside``) carries its sum in a ``TRAILER_BYTES`` trailer
after the chunk's bytes: magic ``b"TKVC"``, a version byte, three zero bytes, the sum
(u64 little-endian).  Any process that reads the object checks the trailer against the
bytes it got, with no state of the writer's.

``Verify`` names when a level's reads are checked (the tier option and store key
``verify``).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from tierkv import xxh3
from tierkv.enums import StrEnum
from tierkv.errors import ConfigError

log = logging.getLogger("tierkv")

#: magic, version, pad, sum
_TRAILER = struct.Struct("<4sB3xQ")
TRAILER_BYTES = _TRAILER.size
TRAILER_MAGIC = b"TKVC"
TRAILER_VERSION = 1


class Verify(StrEnum):
    """When the engine checks a level's reads against the chunk's sum."""

    #: only tiers whose bytes can change outside this process (pooled, remote, disk): the default
    EXTERNAL = "external"
    #: every read, local tiers (``hbm``, ``dram``) too
    ALWAYS = "always"


def parse_verify(raw: Any, what: str) -> Verify:
    """The ``verify`` option's value (``ConfigError`` naming ``what`` for anything else)."""
    if isinstance(raw, Verify):
        return raw
    if type(raw) is str and raw in Verify._value2member_map_:
        return Verify(raw)
    raise ConfigError(f"{what}: 'verify' must be one of {[v.value for v in Verify]}, got {raw!r}")


def chunk_sum(parts: Sequence[torch.Tensor]) -> int:
    """xxh3-64 of a chunk's parts, concatenated."""
    return chunk_sums([parts])[0]


def chunk_sums(objs: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """``chunk_sum`` of each chunk (a large batch hashed on two threads)."""
    keep: list[torch.Tensor] = []  # host copies of parts off the host, alive until hashed
    ranges: list[list[tuple[int, int]]] = []
    for parts in objs:
        r = []
        for p in parts:
            if p.numel():
                if p.device.type != "cpu" or not p.is_contiguous():
                    p = p.contiguous().cpu()
                    keep.append(p)
                r.append((p.data_ptr(), p.numel() * p.element_size()))
        ranges.append(r)
    return xxh3.sum_many(ranges)


class ReadSums:
    """A read's request that the medium sum what it copies (``Tier.sums_copies``): ``sums[i]`` becomes the
    xxh3-64 of the first ``nbytes[i]`` bytes of object ``i`` as the read wrote them into its destination
    parts, or stays None where the medium did not sum it (the caller sums those bytes itself)."""

    __slots__ = ("nbytes", "sums")

    def __init__(self, nbytes: list[int]) -> None:
        self.nbytes = nbytes
        self.sums: list[Optional[int]] = [None] * len(nbytes)

    def part(self, idx: Sequence[int]) -> ReadSums:
        """The request for the objects at ``idx`` alone."""
        return ReadSums([self.nbytes[i] for i in idx])


def _packed(sums: Sequence[int]) -> torch.Tensor:
    """The trailers of ``sums``, end to end, in one host tensor."""
    n = len(sums)
    raw = bytearray(n * TRAILER_BYTES)
    pack = _TRAILER.pack_into
    for i, s in enumerate(sums):
        pack(raw, i * TRAILER_BYTES, TRAILER_MAGIC, TRAILER_VERSION, s)
    return torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)


def trailers(sums: Sequence[int], device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """One packed trailer per sum: views of one buffer (one registration covers a batch)."""
    n = len(sums)
    buf = _packed(sums)
    if device is not None and device.type != "cpu":
        buf = buf.to(device)
    return list(buf.split(TRAILER_BYTES)) if n else []


class TrailerArena(threading.local):
    """Trailer memory of this thread's calls, reused call after call (``views``, ``packed``).

    A pool registers the memory a transfer touches and caches that registration; a
    fresh trailer buffer per call would be registered anew each time.  One buffer
    per (use, device) per thread, grown as needed, keeps it registered once.  After
    a call a medium abandoned at its deadline (it may still touch the buffer), the
    caller ``drop``s it: the next call gets a fresh one.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}

    def _buf(self, use: str, n: int, device: Optional[torch.device]) -> torch.Tensor:
        key = (use, str(device or "cpu"))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n * TRAILER_BYTES:
            cap = 64
            while cap < n:
                cap *= 2
            buf = self._bufs[key] = torch.empty(cap * TRAILER_BYTES, dtype=torch.uint8, device=device)
        return buf

    def views(self, n: int, device: Optional[torch.device] = None) -> list[torch.Tensor]:
        """``n`` trailer-sized destinations, consecutive views of this thread's read buffer."""
        if not n:
            return []
        return list(self._buf("read", n, device)[:n * TRAILER_BYTES].split(TRAILER_BYTES))

    def packed(self, sums: Sequence[int], device: Optional[torch.device] = None) -> list[torch.Tensor]:
        """``trailers(sums)`` written into this thread's write buffer."""
        n = len(sums)
        if not n:
            return []
        buf = self._buf("write", n, device)[:n * TRAILER_BYTES]
        buf.copy_(_packed(sums))
        return list(buf.split(TRAILER_BYTES))

    def drop(self) -> None:
        """Let this thread's buffers go (a medium may still touch them): the next call makes fresh ones."""
        self._bufs.clear()


def trailer_buffers(n: int, device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """``n`` trailer-sized destinations, views of one buffer."""
    if not n:
        return []
    buf = torch.empty(n * TRAILER_BYTES, dtype=torch.uint8, device=device)
    return list(buf.split(TRAILER_BYTES))


def read_trailers(ts: Sequence[torch.Tensor]) -> list[Optional[int]]:
    """``read_trailer`` of each; one pass over the buffer when they are the consecutive host views
    ``trailer_buffers`` made."""
    n = len(ts)
    if not n:
        return []
    first = ts[0]
    base, st = first.data_ptr(), first.untyped_storage().data_ptr()
    if (first.device.type != "cpu" or first.dtype != torch.uint8
            or any(t.numel() != TRAILER_BYTES or t.data_ptr() != base + i * TRAILER_BYTES
                   or t.untyped_storage().data_ptr() != st for i, t in enumerate(ts))):
        return [read_trailer(t) for t in ts]
    raw = ctypes.string_at(base, n * TRAILER_BYTES)  # (views of one live storage, end to end)
    out: list[Optional[int]] = []
    for magic, version, s in _TRAILER.iter_unpack(raw):
        out.append(s if magic == TRAILER_MAGIC and version == TRAILER_VERSION else None)
    return out


def read_trailer(t: torch.Tensor) -> Optional[int]:
    """The sum a trailer holds, or None when it is not one (wrong magic or version)."""
    if t.device.type != "cpu":
        t = t.cpu()
    magic, version, s = _TRAILER.unpack(t.numpy().tobytes())
    if magic != TRAILER_MAGIC or version != TRAILER_VERSION:
        return None
    return s


class CorruptLog:
    """Rate-limited warnings of corrupt copies: at most one line per tier every ``interval`` seconds, with how
    many more were found since."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def found(self, tier: str, keys: Sequence[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(tier, 0.0):
                self._quiet[tier] = self._quiet.get(tier, 0) + len(keys)
                return
            self._next[tier] = now + self.interval
            quiet = self._quiet.pop(tier, 0)
        more = f" (and {len(keys) - 1} more in this read)" if len(keys) > 1 else ""
        since = f"; {quiet} more since the last line" if quiet else ""
        log.warning("tierkv: tier %s: chunk %s failed its checksum%s: dropped, read as a miss%s",
                    tier, keys[0][:80], more, since)
