"""Large objects of ``SSDTier``: an object too large for one record is stored as pieces and a manifest.

A record must fit a region's largest object slot (``SSDTier.max_slot``, an eighth of a region's usable
bytes: what keeps the capacity bound, see ``tier.py``).  An object of more than ``Geometry.single``
bytes (the most one record holds under that rule, whatever its key) is split into ``count`` pieces of
``piece`` bytes (the last one shorter), each an ordinary record under a *piece key*, followed by a
*manifest* record under the object's own key:

* piece ``i`` of the object whose key digest is ``d``: key ``"\\x00" + "%016x" % d + "%08x" % i``
  (25 ASCII characters; the store's keys never hold NUL, so no key of the store is a piece key), payload
  the manifest's 8-byte *nonce* followed by the piece's bytes;
* the manifest: flags ``FLAG_LARGE``, raw length the object's length (so the index, the summaries and the
  checkpoint carry the object's size), stored length ``TABLE.size``, payload the table below.

Table (little-endian): magic "TKVL", version u16, pad u16, count u32, piece u64, total u64, nonce u64.

Pieces are ordinary records: summed, written, sealed, reclaimed, checkpointed and named in the dead log
like any other, so a large object has every guarantee a small one has.  What ties them together:

* A read looks the manifest up, reads its table, then reads every piece in one batch into the caller's
  buffer (each piece's nonce into a scratch beside it).  It is served only if every piece is there and
  carries the manifest's nonce: a piece from another put of the key (a process killed while putting it
  again) never serves, so the object is whole or a miss.  A manifest whose piece is gone or carries
  another nonce is dropped with its pieces (counted ``corrupt``).
* The pieces are written and in the file before the manifest is appended; a piece or the manifest that
  fails leaves no piece behind (removed at once).  A reopen drops the pieces no manifest claims (a
  process killed before the manifest was written): ``orphans``.
* Removing, replacing or dropping the manifest removes its pieces.
* ``footprint`` of a large object is the sum of its pieces' footprints and its manifest's, so the
  store's accounting bounds what it takes on disk exactly as for small objects.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from . import format as F

TABLE = struct.Struct("<4sHHIQQQ")
TABLE_MAGIC = b"TKVL"
NONCE = 8  # bytes of nonce before each piece's bytes
PIECE_KEY_LEN = 25
#: raw lengths are u32 in the index and the summaries
MAX_OBJECT = (1 << 32) - 1
#: the footprint of a longer object: more than any capacity, so the store refuses it (``too_large``)
NEVER = 1 << 62


def record_footprint(nbytes):
    """What one record of ``nbytes`` takes at most (an int or a numpy array of them): the record with the
    longest key and the most pad, 64-byte aligned, and its summary entry and key."""
    return (F.REC_HDR + F.MAX_KEY + nbytes + F.pad_allowance(nbytes) + F.ALIGN - 1) // F.ALIGN * F.ALIGN \
        + F.ENTRY + F.MAX_KEY


class Geometry(NamedTuple):
    """The size rule of a region size: ``single`` the most bytes one record holds (any key, any pad),
    ``piece`` the most bytes of an object one piece holds."""

    region_size: int
    single: int
    piece: int

    @classmethod
    def of(cls, region_size: int) -> "Geometry":
        usable = region_size - 2 * F.BLOCK - F.FOOTER
        max_slot = usable // 8
        single = (max_slot - F.ENTRY - F.MAX_KEY) // F.ALIGN * F.ALIGN - F.REC_HDR - F.MAX_KEY
        if single >= F.DIRECT_MIN:  # (a payload this long may get a pad: ``format.pad_allowance``)
            single = max(F.DIRECT_MIN - 1, single - (F.BLOCK - 1))
        return cls(region_size, single, single - NONCE)

    def layout(self, total: int) -> tuple[int, int]:
        """(count, piece) of an object of ``total`` bytes (more than ``single``): pieces of equal length
        but the last, which is shorter."""
        count = -(-total // self.piece)
        return count, -(-total // count)

    def footprint(self, nbytes):
        """What an object of ``nbytes`` takes (an int or a numpy array of them): one record, or its pieces
        and manifest; ``NEVER`` for one longer than ``MAX_OBJECT``."""
        if isinstance(nbytes, np.ndarray):
            n = nbytes.astype(np.int64)
            small = record_footprint(n)
            count = np.maximum(-(-n // self.piece), 1)
            piece = -(-n // count)
            last = n - (count - 1) * piece
            big = ((count - 1) * record_footprint(piece + NONCE) + record_footprint(last + NONCE)
                   + record_footprint(TABLE.size))
            return np.where(n > MAX_OBJECT, NEVER, np.where(n > self.single, big, small))
        n = int(nbytes)
        if n <= self.single:
            return int(record_footprint(n))
        if n > MAX_OBJECT:
            return NEVER
        count, piece = self.layout(n)
        last = n - (count - 1) * piece
        return int((count - 1) * record_footprint(piece + NONCE) + record_footprint(last + NONCE)
                   + record_footprint(TABLE.size))


def piece_key(digest: int, i: int) -> str:
    return f"\x00{digest:016x}{i:08x}"


def piece_keys(digest: int, lo: int, hi: int) -> list[str]:
    return [f"\x00{digest:016x}{i:08x}" for i in range(lo, hi)]


def pack_table(count: int, piece: int, total: int, nonce: int) -> bytes:
    return TABLE.pack(TABLE_MAGIC, F.VERSION, 0, count, piece, total, nonce)


class Table(NamedTuple):
    count: int  # type: ignore[assignment]  # a field that shadows tuple.count, by name only
    piece: int
    total: int
    nonce: int


def parse_table(b, geom: Geometry) -> "Table | None":
    """The table of a manifest's payload, or None if it is not one this geometry could have written."""
    if len(b) != TABLE.size:
        return None
    magic, version, _, count, piece, total, nonce = TABLE.unpack_from(b, 0)
    if magic != TABLE_MAGIC or version != F.VERSION or not 0 < piece <= geom.piece or count < 2:
        return None
    if not (count - 1) * piece < total <= count * piece:
        return None
    return Table(count, piece, total, nonce)


def slices(parts: Sequence[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Views of bytes ``[lo, hi)`` of the concatenation of ``parts`` (1-D uint8 tensors)."""
    out = []
    at = 0
    for p in parts:
        n = p.numel()
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append(p[a - at:b - at])
        at += n
        if at >= hi:
            break
    return out


# -- opening a directory --------------------------------------------------------------
def piece_mask(key_len: np.ndarray, key_start: np.ndarray, keys) -> np.ndarray:
    """Which candidates are pieces (a key of ``PIECE_KEY_LEN`` starting with NUL)."""
    mask = key_len == PIECE_KEY_LEN
    if mask.any():
        kb = np.frombuffer(keys, dtype=np.uint8)
        at = np.flatnonzero(mask)
        mask[at] = kb[key_start[at]] == 0
    return mask


_HEX = np.full(256, -1, dtype=np.int64)
_HEX[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16)


def _parse_hex(cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values of rows of hex digits (uint64) and whether each row was all hex digits."""
    d = _HEX[cols]
    ok = (d >= 0).all(axis=1)
    v = np.zeros(len(cols), dtype=np.uint64)
    for j in range(cols.shape[1]):  # (a column at a time: 24 numpy calls whatever the count)
        v = (v << np.uint64(4)) | np.maximum(d[:, j], 0).astype(np.uint64)
    return v, ok


def claims(digest: np.ndarray, raw_len: np.ndarray, key_start: np.ndarray, key_len: np.ndarray, keys,
            geom: Geometry, alive: "np.ndarray | None"):
    """(pieces mask, the pieces' positions, the position of the manifest among them that claims each or -1):
    a piece is claimed by a manifest (``alive``: one it marks) of its owner's digest when its index is
    below the manifest's count.  Vectorised."""
    pieces = piece_mask(key_len, key_start, keys)
    at = np.flatnonzero(pieces)
    claim = np.full(len(at), -1, dtype=np.int64)
    if not len(at):
        return pieces, at, claim
    kb = np.frombuffer(keys, dtype=np.uint8)
    rows = kb[key_start[at][:, None] + np.arange(1, PIECE_KEY_LEN)]
    owner, ok1 = _parse_hex(rows[:, :16])
    index, ok2 = _parse_hex(rows[:, 16:])
    man = (~pieces) & (raw_len > geom.single)
    if alive is not None:
        man &= alive
    m_at = np.flatnonzero(man)
    m_dig = digest[m_at].astype(np.uint64)
    order = np.argsort(m_dig, kind="stable")
    m_dig = m_dig[order]
    if len(m_dig):
        pos = np.minimum(np.searchsorted(m_dig, owner), len(m_dig) - 1)
        count = -(-raw_len[m_at[order]].astype(np.int64)[pos] // geom.piece)
        claimed = (m_dig[pos] == owner) & (index.astype(np.int64) < count) & ok1 & ok2
        claim[claimed] = m_at[order][pos[claimed]]
    return pieces, at, claim


def orphans(digest: np.ndarray, raw_len: np.ndarray, key_start: np.ndarray, key_len: np.ndarray, keys,
            geom: Geometry, alive: "np.ndarray | None" = None) -> np.ndarray:
    """Which candidates are pieces that no manifest among them claims (its digest, an index below its
    count); ``alive`` restricts the manifests to those it marks.  Vectorised."""
    _, at, claim = claims(digest, raw_len, key_start, key_len, keys, geom, alive)
    out = np.zeros(len(digest), dtype=bool)
    out[at] = claim < 0
    return out


def incomplete(digest: np.ndarray, raw_len: np.ndarray, key_start: np.ndarray, key_len: np.ndarray, keys,
               geom: Geometry, alive: "np.ndarray | None" = None) -> np.ndarray:
    """Which candidates are manifests missing a piece among them (``alive``: among those it marks): a
    large object that can never read whole (its pieces' file lost or damaged).  Vectorised."""
    man = ~piece_mask(key_len, key_start, keys) & (raw_len > geom.single)
    if alive is not None:
        man &= alive
    if not man.any():  # (no large object: nothing more to look at)
        return man
    _, at, claim = claims(digest, raw_len, key_start, key_len, keys, geom, None)
    if alive is not None:
        claim = claim[alive[at]]
    have = np.bincount(claim[claim >= 0], minlength=len(digest))  # (each piece key once: candidates are resolved)
    return man & (have < -(-raw_len.astype(np.int64) // geom.piece))
