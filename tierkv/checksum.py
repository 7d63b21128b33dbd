"""Chunk checksums: one xxh3-64 per chunk, computed where its bytes enter the store.

The sum is xxh3-64 (seed 0) of the chunk's bytes, its parts in order: the value the
``ssd`` tier writes as a record's payload sum (``tiers/ssd/format.py``, an
uncompressed xxh3 record), so the same number stands for the chunk in every tier.
It is computed in C over each part's buffer (``xxhash``), never byte by byte.

A pooled object (``Tier.sum_inside``) carries its sum in a ``TRAILER_BYTES`` trailer
after the chunk's bytes: magic ``b"TKVC"``, a version byte, three zero bytes, the sum
(u64 little-endian).  Any process that reads the object checks the trailer against the
bytes it got, with no state of the writer's.

``Verify`` names when a level's reads are checked (the tier option and store key
``verify``).
"""

from __future__ import annotations

import enum
import logging
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import xxhash

from tierkv.errors import ConfigError

log = logging.getLogger("tierkv")

_DIGEST = xxhash.xxh3_64_intdigest

#: magic, version, pad, sum
_TRAILER = struct.Struct("<4sB3xQ")
TRAILER_BYTES = _TRAILER.size
TRAILER_MAGIC = b"TKVC"
TRAILER_VERSION = 1


class Verify(enum.StrEnum):
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


def _host(p: torch.Tensor) -> Any:
    """A buffer over a 1-D uint8 part's bytes (a device part is copied to host first)."""
    if p.device.type != "cpu":
        p = p.cpu()
    return p.numpy()


def chunk_sum(parts: Sequence[torch.Tensor]) -> int:
    """xxh3-64 of a chunk's parts, concatenated."""
    if len(parts) == 1:
        return _DIGEST(_host(parts[0]))
    h = xxhash.xxh3_64()
    for p in parts:
        if p.numel():
            h.update(_host(p))
    return h.intdigest()


def chunk_sums(objs: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """``chunk_sum`` of each chunk."""
    return [chunk_sum(parts) for parts in objs]


def trailers(sums: Sequence[int], device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """One packed trailer per sum: views of one buffer (one registration covers a batch)."""
    n = len(sums)
    raw = bytearray(n * TRAILER_BYTES)
    pack = _TRAILER.pack_into
    for i, s in enumerate(sums):
        pack(raw, i * TRAILER_BYTES, TRAILER_MAGIC, TRAILER_VERSION, s)
    buf = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    if device is not None and device.type != "cpu":
        buf = buf.to(device)
    return list(buf.split(TRAILER_BYTES)) if n else []


def trailer_buffers(n: int, device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """``n`` trailer-sized destinations, views of one buffer."""
    if not n:
        return []
    buf = torch.empty(n * TRAILER_BYTES, dtype=torch.uint8, device=device)
    return list(buf.split(TRAILER_BYTES))


def read_trailer(t: torch.Tensor) -> Optional[int]:
    """The sum a trailer holds, or None when it is not one (wrong magic or version)."""
    magic, version, s = _TRAILER.unpack(bytes(_host(t)))
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
