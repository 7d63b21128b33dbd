"""On-disk layouts of the ``ssd`` log engine (all integers little-endian).

Region file ``regions/rNNNNNN.region`` (``region_size`` bytes, preallocated)::

    [0, 4096)            region header: magic "TKVR", version u16, pad u16, index u32,
                         seq u64 (bumped each time the region is reused), region_size u64,
                         check u64 (xxh3-64 of the 32 bytes before it)
    [4096, ...)          records, each starting on a 64-byte boundary
    [..., region_size)   summary, written when the region is sealed: entries, keys, padding,
                         and a 64-byte footer ending exactly at ``region_size``

Record (header 64 bytes, then the key, ``pad`` bytes, then the stored payload)::

    magic "TKVO", version u8, flags u8 (1 lz4, 2 payload sum is CRC32C, 4 reserved: never served,
    8 a large object's manifest: raw_len is the object's length, the payload its table, ``large.py``),
    key_len u16, seq u64 (the region's seq: a record left from an earlier use of the
    region never parses as current), raw_len u32, stored_len u32, payload sum u64,
    header check u64 (xxh3-64 of the 64 header bytes with this field zeroed, and the key),
    pad u16 (0 to 4095: bytes between key and payload), zero to 64

A record's payload starts ``pad`` bytes after its key.  With O_DIRECT, a large payload held in
huge-page memory (``tierkv.hostmem.contiguous``) is written to the file from where it is: ``pad``
gives its file offset the phase of its address modulo 4 KiB, so the whole blocks between go to
the device without a copy (``segmentwriter.py``).  Records without a pad hold 0 there.

Summary: ``count`` entries of 24 bytes (digest u64, offset u32, record length u32,
raw_len u32, key_len u16, flags u8, pad u8), then the keys back to back, padding,
and the footer: magic "TKVS", version u16, pad u16, seq u64, count u32, body length u32,
body sum u64 (xxh3-64 of entries and keys), footer check u64 (of the 36 bytes before it).

Checkpoint ``checkpoint``: see ``checkpoint.py``.

Every structure carries a check: a torn or flipped byte makes it fail to parse, never
parse as something else.  The header check is always xxh3-64; the payload sum is the
one the record's flags name, so a tier of either ``checksum`` setting reads both.
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple, Optional

import numpy as np
import xxhash

from tierkv.hostmem import page_buffer

try:
    import crc32c as _crc32c_mod

    def crc32c_sum(chunks) -> int:
        v = 0
        for c in chunks:
            v = _crc32c_mod.crc32c(c, v)
        return v
except ImportError:  # pragma: no cover - a dependency; records then carry xxh3 sums
    crc32c_sum = None  # type: ignore[assignment]  # None marks the missing package

BLOCK = 4096  # the unit of every write and of O_DIRECT reads
ALIGN = 64  # records start on this boundary
VERSION = 1
MAX_KEY = 200  # bytes (the store's keys are at most 200 UTF-8 bytes)

FLAG_LZ4 = 1
FLAG_CRC32C = 2
FLAG_TOMB = 4
FLAG_LARGE = 8  # a large object's manifest (``large.py``): raw_len is the object's, the payload its table
CHECKSUMS = ("xxh3", "crc32c")

REGION_MAGIC = b"TKVR"
RECORD_MAGIC = b"TKVO"
SUMMARY_MAGIC = b"TKVS"

_REGION = struct.Struct("<4sHHIQQ")  # 32 bytes, then check u64
_RECORD = struct.Struct("<4sBBHQIIQ")  # 32 bytes, then header check u64 at 32, pad u16 at 40, zero to 64
REC_HDR = 64
#: the whole 64-byte record header, its check zero (packed in one call, then the check at RECORD_CHECK_AT)
RECORD_STRUCT = struct.Struct("<4sBBHQIIQQH22x")
RECORD_CHECK_AT = _RECORD.size
#: with O_DIRECT, uncompressed payloads of at least this many bytes in huge-page memory are written from there
DIRECT_MIN = 128 << 10
_CHECK = struct.Struct("<Q")
CHECK_STRUCT = _CHECK
_FOOTER = struct.Struct("<4sHHQIIQ")  # 36 bytes, then check u64
FOOTER = 64
ENTRY_DTYPE = np.dtype([("digest", "<u8"), ("offset", "<u4"), ("rec_len", "<u4"), ("raw_len", "<u4"),
                        ("key_len", "<u2"), ("flags", "u1"), ("pad", "u1")])
ENTRY = ENTRY_DTYPE.itemsize  # 24

#: digests 0 and 1 mark empty and deleted slots of the index
EMPTY, TOMB = 0, 1


def xxh3(chunks) -> int:
    h = xxhash.xxh3_64()
    for c in chunks:
        h.update(c)
    return h.intdigest()


def payload_sum(chunks, flags: int) -> Optional[int]:
    """The sum a record's flags name, or None when this build cannot compute it."""
    if flags & FLAG_CRC32C:
        return None if crc32c_sum is None else crc32c_sum(chunks)
    return xxh3(chunks)


def sum_function(flags: int):
    """The one-call payload sum a record's flags name (a buffer -> int), or None when this build lacks it."""
    if flags & FLAG_CRC32C:
        return None if crc32c_sum is None else _crc32c_mod.crc32c
    return xxhash.xxh3_64_intdigest


def key_digest(kb: bytes) -> int:
    """64-bit digest of a key; never EMPTY or TOMB."""
    d = xxhash.xxh3_64_intdigest(kb)
    return d + 2 if d < 2 else d


def align_up(n: int, a: int = BLOCK) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int = BLOCK) -> int:
    return n // a * a


def aligned_buffer(n: int, populate: bool = False, huge: Optional[bool] = None) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer (what O_DIRECT needs); from 2 MiB on, of huge pages.

    ``tierkv.hostmem.page_buffer``: ``populate`` faults its pages in at once, after the huge-page
    advice, so the pages faulted in are huge ones (an O_DIRECT transfer from or into them is a few
    long segments instead of one per 4 KiB page: docs/ssd.md, "Figures").
    """
    return page_buffer(n, populate, huge)


_ENTRY_STRUCT = struct.Struct("<QIIIHBB")
ENTRY_STRUCT = _ENTRY_STRUCT  # a summary entry: digest, offset, rec_len, raw_len, key_len, flags, pad


def pack_entry(digest: int, offset: int, rec_len: int, raw_len: int, key_len: int, flags: int) -> bytes:
    return _ENTRY_STRUCT.pack(digest, offset, rec_len, raw_len, key_len, flags, 0)


def record_len(key_len: int, stored_len: int) -> int:
    """The length of a record without a pad."""
    return REC_HDR + key_len + stored_len


def pad_allowance(nbytes):
    """The most pad a payload of ``nbytes`` may get (an int, or a numpy array of them)."""
    return (nbytes >= DIRECT_MIN) * (BLOCK - 1)


#: the active image is written out once this much of it is unwritten
WRITE_UNIT = 2 << 20


def measure(rec_len: int) -> int:
    """Live bytes accounted for a record: an upper bound of its region space, summary entry and key included."""
    return (rec_len + ALIGN - 1) // ALIGN * ALIGN + ENTRY + MAX_KEY


def slot_len(rec_len: int) -> int:
    """Bytes of region space a record takes, summary entry included."""
    return align_up(rec_len, ALIGN) + ENTRY


# -- region header ------------------------------------------------------------------
def pack_region_header(buf, index: int, seq: int, region_size: int) -> None:
    buf[:BLOCK] = bytes(BLOCK)
    _REGION.pack_into(buf, 0, REGION_MAGIC, VERSION, 0, index, seq, region_size)
    _CHECK.pack_into(buf, _REGION.size, xxh3([bytes(buf[:_REGION.size])]))


class RegionHeader(NamedTuple):
    index: int  # type: ignore[assignment]  # a field that shadows tuple.index, by name only
    seq: int
    region_size: int


def parse_region_header(b) -> Optional[RegionHeader]:
    """The header, or None; ``magic_ok`` tells a torn header of ours from a foreign file."""
    if len(b) < _REGION.size + 8:
        return None
    magic, version, _, index, seq, region_size = _REGION.unpack_from(b, 0)
    if magic != REGION_MAGIC or version != VERSION:
        return None
    if _CHECK.unpack_from(b, _REGION.size)[0] != xxh3([bytes(b[:_REGION.size])]):
        return None
    return RegionHeader(index, seq, region_size)


def is_region_magic(b) -> bool:
    return bytes(b[:4]) == REGION_MAGIC


# -- records ------------------------------------------------------------------------
def pack_record_header(buf, pos: int, flags: int, kb: bytes, seq: int, raw_len: int, stored_len: int,
                       psum: int, pad: int = 0) -> None:
    """Header and key at ``buf[pos:]`` (the payload follows ``pad`` bytes later, already in place or not)."""
    head = bytearray(REC_HDR)
    RECORD_STRUCT.pack_into(head, 0, RECORD_MAGIC, VERSION, flags, len(kb), seq, raw_len, stored_len, psum, 0, pad)
    h = xxhash.xxh3_64(head)
    h.update(kb)
    _CHECK.pack_into(head, _RECORD.size, h.intdigest())
    end = pos + REC_HDR
    buf[pos:end] = head
    buf[end:end + len(kb)] = kb


def reseq_record(buf, pos: int, seq: int) -> None:
    """Move a record (already copied to ``buf[pos:]``) into a region of another seq."""
    magic, version, flags, key_len, _, raw_len, stored_len, psum, _, pad = RECORD_STRUCT.unpack_from(buf, pos)  # noqa: RUF059 - the unpacked names document the layout
    kb = bytes(buf[pos + REC_HDR:pos + REC_HDR + key_len])
    pack_record_header(buf, pos, flags, kb, seq, raw_len, stored_len, psum, pad)


class RecordHeader(NamedTuple):
    flags: int
    key: bytes
    seq: int
    raw_len: int
    stored_len: int
    psum: int
    pad: int = 0

    @property
    def body_at(self) -> int:
        """Where the payload starts, from the record's start."""
        return REC_HDR + len(self.key) + self.pad

    @property
    def rec_len(self) -> int:
        return REC_HDR + len(self.key) + self.pad + self.stored_len


def parse_record_header(head, key_bytes) -> Optional[RecordHeader]:
    """Check a record's 64-byte header against the key bytes that follow it; None if bad."""
    if len(head) < REC_HDR:
        return None
    magic, version, flags, key_len, seq, raw_len, stored_len, psum, stored_check, pad = \
        RECORD_STRUCT.unpack_from(head, 0)
    if magic != RECORD_MAGIC or version != VERSION or key_len != len(key_bytes) or pad >= BLOCK:
        return None
    fixed = bytearray(head[:REC_HDR])
    fixed[_RECORD.size:_RECORD.size + 8] = bytes(8)
    if stored_check != xxh3([fixed, key_bytes]):
        return None
    return RecordHeader(flags, bytes(key_bytes), seq, raw_len, stored_len, psum, pad)


def record_key_len(head) -> int:
    """The key length a header claims (unchecked: parse before trusting it)."""
    return struct.unpack_from("<H", head, 6)[0] if len(head) >= 8 else 0


def parse_record(view, seq: Optional[int], verify_payload: bool = True) -> Optional[RecordHeader]:
    """A whole record at the start of ``view``, checked (payload sum too unless told not to)."""
    if len(view) < REC_HDR:
        return None
    klen = record_key_len(view)
    if len(view) < REC_HDR + klen:
        return None
    h = parse_record_header(view[:REC_HDR], bytes(view[REC_HDR:REC_HDR + klen]))
    if h is None or (seq is not None and h.seq != seq) or len(view) < h.rec_len:
        return None
    if verify_payload and not h.flags & FLAG_TOMB:
        s = payload_sum([view[h.body_at:h.rec_len]], h.flags)
        if s is None or s != h.psum:
            return None
    return h


# -- summaries ----------------------------------------------------------------------
def summary_bytes(count: int, key_bytes: int) -> int:
    return count * ENTRY + key_bytes + FOOTER


def summary_start(region_size: int, count: int, key_bytes: int) -> int:
    return align_down(region_size - summary_bytes(count, key_bytes))


def pack_summary(buf, region_size: int, seq: int, entries: bytes, keys: bytes, count: int) -> int:
    """Write the summary into the region image ``buf``; returns where it starts (block aligned)."""
    start = summary_start(region_size, count, len(keys))
    body = entries + keys
    buf[start:region_size] = bytes(region_size - start)
    buf[start:start + len(body)] = body
    fpos = region_size - FOOTER
    _FOOTER.pack_into(buf, fpos, SUMMARY_MAGIC, VERSION, 0, seq, count, len(body), xxh3([body]))
    _CHECK.pack_into(buf, fpos + _FOOTER.size, xxh3([bytes(buf[fpos:fpos + _FOOTER.size])]))
    return start


class Footer(NamedTuple):
    seq: int
    count: int  # type: ignore[assignment]  # a field that shadows tuple.count, by name only
    body_len: int
    body_sum: int


def parse_footer(b) -> Optional[Footer]:
    """The footer in the last 64 bytes of ``b``, or None."""
    if len(b) < FOOTER:
        return None
    f = bytes(b[len(b) - FOOTER:])
    magic, version, _, seq, count, body_len, body_sum = _FOOTER.unpack_from(f, 0)
    if magic != SUMMARY_MAGIC or version != VERSION:
        return None
    if _CHECK.unpack_from(f, _FOOTER.size)[0] != xxh3([f[:_FOOTER.size]]):
        return None
    if body_len != count * ENTRY + (body_len - count * ENTRY) or body_len < count * ENTRY:
        return None
    return Footer(seq, count, body_len, body_sum)


def parse_summary_body(body, count: int):
    """(entries array, keys bytes, key offsets) of a summary body, or None if inconsistent."""
    entries = np.frombuffer(body, dtype=ENTRY_DTYPE, count=count).copy()
    keys = bytes(body[count * ENTRY:])
    klen = entries["key_len"].astype(np.int64)
    if int(klen.sum()) != len(keys):
        return None
    offs = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(klen, out=offs[1:])
    return entries, keys, offs
