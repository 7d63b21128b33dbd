"""``ssd``: one file per chunk in a directory, surviving restarts.

On-disk object (little-endian)::

    header (64 bytes): magic "TKV1", version u16, flags u16, raw_len u64,
                       stored_len u64, checksum u64 (of the stored bytes: CRC32C
                       when flag 2 is set, else xxh3-64),
                       key_len u16, header check u64 (xxh3-64 of these 64 bytes,
                       the check itself zeroed, and the key), zero padding
    key bytes (key_len)
    padding up to data_offset (64 + key_len, or 4096 with O_DIRECT)
    stored bytes (stored_len): the chunk, lz4-compressed when flag 1 is set

Invariants:
    * Atomic writes: an object is written to a hidden temp file and renamed into
      place, so a crash mid-write never leaves a readable half-object; temp files
      are swept on open.
    * A read verifies length and checksum; a short, torn or corrupt object is a
      miss, is deleted and is counted in ``errors`` — never wrong bytes.
    * ``recover()`` rebuilds the index from the directory, so a restarted process
      finds what it stored.  Everything written before ``flush()`` / ``close()``
      survives a crash of the process (fsync of files and directories).
    * Files are 0600 in a directory tree 0700 that this user owns.
    * Disk full (or any I/O error) refuses the write and counts it; it is never
      raised into the caller's path.
Batches are spread over a thread pool (pread/pwrite release the GIL).  The
payload sum is xxh3-64 by default (``checksum: "xxh3"``): it runs outside the GIL,
so reader threads sum in parallel and never stall the engine's thread, and on
data just read (still in the core's cache) it is about twice as fast as
CRC32C, the other choice (``checksum: "crc32c"``, flag 2).  Either kind of file
verifies whatever the tier writes now.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch

from tierkv.buffers import host_copy, share_work
from tierkv.errors import ConfigError

from .base import Parts, Tier

try:
    import xxhash

    def _checksum(chunks) -> int:
        h = xxhash.xxh3_64()
        for c in chunks:
            h.update(c)
        return h.intdigest()
except ImportError:  # pragma: no cover - xxhash is a dependency; zlib keeps us working without it
    import zlib

    def _checksum(chunks) -> int:
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        return crc | (1 << 63)  # tagged so an xxhash file never validates against crc

try:
    import crc32c as _crc32c

    def _crc(chunks) -> int:
        v = 0
        for c in chunks:
            v = _crc32c.crc32c(c, v)
        return v
except ImportError:  # pragma: no cover - a dependency; files then carry xxh3 sums
    _crc = None

log = logging.getLogger(__name__)

MAGIC = b"TKV1"
VERSION = 1
FLAG_LZ4 = 1
FLAG_CRC32C = 2  # the payload sum is CRC32C, else xxh3-64
CHECKSUMS = ("xxh3", "crc32c")
_HDR = struct.Struct("<4sHHQQQH")  # 34 bytes, then the header check (u64), padded to 64
_CHECK = struct.Struct("<Q")
HDR_SIZE = 64
BLOCK = 4096
_SAFE = re.compile(r"^[0-9A-Za-z_-][0-9A-Za-z_.-]{0,199}$")
SUFFIX = ".kv"
TMP_PREFIX = ".tmp."


def _can_sum(flags: int) -> bool:
    """Whether this build computes the payload sum a header's flags name."""
    return not flags & FLAG_CRC32C or _crc is not None


def _payload_sum(chunks, flags: int) -> int:
    """The sum of a payload as its header's flags name it (check ``_can_sum`` first)."""
    return _crc(chunks) if flags & FLAG_CRC32C else _checksum(chunks)


def _file_name(key: str) -> str:
    if _SAFE.match(key):
        return key + SUFFIX
    return "h-" + hashlib.sha256(key.encode()).hexdigest() + SUFFIX


def _shard(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=1).hexdigest()


def _host_bytes(part: torch.Tensor) -> memoryview:
    if part.device.type != "cpu":
        part = part.cpu()
    return memoryview(part.numpy()).cast("B")


def _aligned(n: int) -> memoryview:
    """A zeroed, BLOCK-aligned writable buffer of ``n`` bytes (anonymous mmap is page aligned)."""
    return memoryview(mmap.mmap(-1, max(n, BLOCK)))[:n]


class SSDTier(Tier):
    """Chunks as checksummed files under ``path``."""

    medium = "ssd"
    locality = "disk"
    persistent = True

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        path: str,
        compression: Optional[str] = None,
        direct_io: bool = False,
        io_threads: Optional[int] = None,
        fsync: str = "flush",
        checksum: str = "xxh3",
    ) -> None:
        super().__init__(name, capacity_bytes)
        if checksum not in CHECKSUMS:
            raise ConfigError(f"tier {name!r}: checksum must be one of {', '.join(CHECKSUMS)}, got {checksum!r}")
        if checksum == "crc32c" and _crc is None:
            raise ConfigError(f"tier {name!r}: checksum 'crc32c' needs the crc32c package")
        self.checksum = checksum
        if compression not in (None, "none", "lz4"):
            raise ConfigError(f"tier {name!r}: compression must be 'lz4' or 'none', got {compression!r}")
        if fsync not in ("flush", "always", "never"):
            raise ConfigError(f"tier {name!r}: fsync must be 'flush', 'always' or 'never', got {fsync!r}")
        self.compression = "lz4" if compression == "lz4" else None
        if self.compression:
            import lz4.block  # noqa: F401  (fail at config time, not on the hot path)
        self.direct_io = bool(direct_io)
        self.fsync = fsync
        self.path = os.path.abspath(os.path.expanduser(path))
        self._prepare_dir()
        if self.direct_io:
            self._probe_direct()
        self._objects: dict[str, tuple[int, int]] = {}  # key -> (raw nbytes, file size)
        self._used = 0
        self._dirty: set[str] = set()
        self._dirs: set[str] = set()
        self._paths: dict[str, str] = {}
        self._counters = {"io_errors": 0, "corrupt": 0, "rereads": 0, "enospc": 0, "swept_temp": 0}
        # page-cache copies and checksums want a core each: more threads than cores only contend
        self._threads = max(1, int(io_threads)) if io_threads else min(4, max(2, os.cpu_count() or 2))
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=f"tierkv-{name}")

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "SSDTier":
        capacity = cls.pop_capacity(name, options)
        path = options.pop("path", None)
        if not path:
            raise ConfigError(f"tier {name!r} (ssd): 'path' is required (a directory tierkv may own)")
        kw = {k: options.pop(k) for k in ("compression", "direct_io", "io_threads", "fsync", "checksum")
              if k in options}
        cls.reject_unknown(name, options)
        return cls(name, capacity, str(path), **kw)

    # -- directory ----------------------------------------------------------------
    def _prepare_dir(self) -> None:
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"tier {self.name!r}: cannot create directory {self.path}: {e}") from e
        st = os.stat(self.path)
        if st.st_uid != os.geteuid():
            raise ConfigError(f"tier {self.name!r}: directory {self.path} is owned by uid {st.st_uid}, not us")
        if st.st_mode & 0o077:
            os.chmod(self.path, 0o700)

    def _probe_direct(self) -> None:
        probe = os.path.join(self.path, TMP_PREFIX + "probe")
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
            try:
                os.write(fd, _aligned(BLOCK))
            finally:
                os.close(fd)
        except OSError as e:
            raise ConfigError(f"tier {self.name!r}: direct_io is not supported on {self.path}: {e}") from e
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass

    def _data_offset(self, key_len: int) -> int:
        return BLOCK if self.direct_io else HDR_SIZE + key_len

    def _obj_path(self, key: str) -> str:
        path = self._paths.get(key)
        if path is None:
            name = _file_name(key)
            path = os.path.join(self.path, _shard(name), name)
            if len(self._paths) < (1 << 20):  # a cache, bounded: paths are cheap to recompute
                self._paths[key] = path
        return path

    def footprint(self, nbytes: int) -> int:
        # header + key + data, in whole filesystem blocks: what the file really costs
        return (HDR_SIZE + 200 + nbytes + BLOCK - 1) // BLOCK * BLOCK if not self.direct_io else \
            BLOCK + (nbytes + BLOCK - 1) // BLOCK * BLOCK

    # -- batch API --------------------------------------------------------------------
    def _map(self, fn, keys, bufs) -> list[bool]:
        """Run ``fn`` over a batch on the I/O threads.

        Each thread takes the next object until none is left: one future per thread,
        not per object (a future costs more than a small object's I/O), and a slow
        object does not hold back a fixed share of the batch.  The calling thread is
        one of them: it is awake already, and it would only wait otherwise
        (``share_work``).
        """
        n = len(keys)
        total = sum(p.numel() for b in bufs for p in b)
        if n <= 1 or total < (1 << 20):
            return [fn(k, b) for k, b in zip(keys, bufs)]
        out = [False] * n

        def one(i: int) -> None:
            out[i] = fn(keys[i], bufs[i])

        share_work(one, n, self._pool, self._threads - 1)
        return out

    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        self._check_open()
        return self._map(self._write_one, keys, srcs)

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        self._check_open()
        return self._map(self._read_one, keys, dsts)

    def _delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            with self._lock:
                obj = self._objects.pop(key, None)
                if obj is not None:
                    self._used -= obj[1]
                self._dirty.discard(key)
                path = self._obj_path(key)
                self._paths.pop(key, None)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._count("io_errors")
                log.warning("tier %s: cannot delete %s: %s", self.name, key, e)

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    # -- one object -----------------------------------------------------------------
    def _write_one(self, key: str, parts: Parts) -> bool:
        raw_len = sum(p.numel() for p in parts)
        views = [_host_bytes(p) for p in parts]
        flags = 0
        payload: list = views
        if self.compression:
            import lz4.block

            joined = views[0] if len(views) == 1 else b"".join(views)
            packed = lz4.block.compress(joined, store_size=False)
            if len(packed) < raw_len:
                payload, flags = [packed], FLAG_LZ4
        stored_len = sum(len(v) for v in payload)
        if self.checksum == "crc32c":
            flags |= FLAG_CRC32C
        kb = key.encode()
        header = bytearray(self._data_offset(len(kb)))
        _HDR.pack_into(header, 0, MAGIC, VERSION, flags, raw_len, stored_len, _payload_sum(payload, flags),
                       len(kb))
        header[HDR_SIZE:HDR_SIZE + len(kb)] = kb
        _CHECK.pack_into(header, _HDR.size, _checksum([header[:HDR_SIZE], kb]))  # check field still zero
        final = self._obj_path(key)
        tmp = os.path.join(os.path.dirname(final), f"{TMP_PREFIX}{os.path.basename(final)}.{os.getpid()}.{threading.get_ident()}")
        fd = -1
        try:
            shard_dir = os.path.dirname(final)
            if shard_dir not in self._dirs:
                os.makedirs(shard_dir, mode=0o700, exist_ok=True)
                self._dirs.add(shard_dir)
            flags_open = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
            if self.direct_io:
                flags_open |= os.O_DIRECT
            fd = os.open(tmp, flags_open, 0o600)
            if self.direct_io:
                total = len(header) + stored_len
                buf = _aligned((total + BLOCK - 1) // BLOCK * BLOCK)
                buf[:len(header)] = header
                pos = len(header)
                for v in payload:
                    buf[pos:pos + len(v)] = v
                    pos += len(v)
                _write_all(fd, [buf])
                os.ftruncate(fd, total)
            else:
                _write_all(fd, [header, *payload])
            if self.fsync == "always":
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._count("enospc" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io_errors")
            log.warning("tier %s: write of %s refused: %s", self.name, key[:16], e)
            return False
        size = len(header) + stored_len
        with self._lock:
            old = self._objects.get(key)
            if old is not None:
                self._used -= old[1]
            self._objects[key] = (raw_len, size)
            self._used += size
            if self.fsync == "flush":
                self._dirty.add(key)
        return True

    def _read_one(self, key: str, parts: Parts) -> bool:
        path = self._obj_path(key)
        want = sum(p.numel() for p in parts)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self.direct_io else 0))
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError:
            self._count("io_errors")
            return False
        try:
            ok = self._read_fd(fd, key, parts, want)
        except OSError as e:
            log.warning("tier %s: read of %s failed: %s", self.name, key[:16], e)
            self._count("io_errors")
            ok = False
        finally:
            os.close(fd)
        if ok is None:  # corrupt or torn: drop it so it is not served again
            self._count("corrupt")
            log.warning("tier %s: object %s is corrupt; dropped", self.name, key[:16])
            self.delete([key])
            return False
        return ok

    def _read_fd(self, fd: int, key: str, parts: Parts, want: int) -> Optional[bool]:
        """True: exact bytes in ``parts``; False: a size mismatch; None: corrupt."""
        if self.direct_io:
            size = os.fstat(fd).st_size
            buf = _aligned((size + BLOCK - 1) // BLOCK * BLOCK)
            got = os.preadv(fd, [buf], 0)
            head = bytes(buf[:min(got, HDR_SIZE + 256)])
        elif not self.compression:
            # one syscall: header, key and payload straight into the caller's buffers
            kb = key.encode()
            head_buf = bytearray(HDR_SIZE + len(kb))
            host = [p if p.device.type == "cpu" else torch.empty(p.numel(), dtype=torch.uint8) for p in parts]
            views = [memoryview(h.numpy()).cast("B") for h in host]
            got = os.preadv(fd, [head_buf, *views], 0)
            meta = _parse_header(bytes(head_buf))
            if meta is None or meta[5] != key:
                return None
            flags, raw_len, stored_len, checksum, key_len, _ = meta
            indexed = self._objects.get(key)
            if indexed is not None and indexed[0] != raw_len:
                return None
            if raw_len != want:
                return False
            if not flags & FLAG_LZ4:
                if got != len(head_buf) + stored_len or stored_len != raw_len:
                    return None
                if not _can_sum(flags):
                    return False  # summed with an algorithm this build lacks: a miss, the file stays
                if _payload_sum(views, flags) != checksum:
                    # the bytes landed in the caller's buffers; if those overlap each other the
                    # sum sees the overlap, not the file: confirm from a private copy first
                    return self._reread(fd, len(head_buf), stored_len, checksum, flags, parts)
                for p, h in zip(parts, host):
                    if h is not p:
                        p.copy_(h)
                return True
            head, buf = bytes(head_buf), None  # written compressed by an earlier configuration
        else:
            head = os.pread(fd, HDR_SIZE + 256, 0)
            buf = None
        meta = _parse_header(head)
        if meta is None:
            return None
        flags, raw_len, stored_len, checksum, key_len, stored_key = meta
        if stored_key != key:
            return None
        indexed = self._objects.get(key)
        if indexed is not None and indexed[0] != raw_len:
            return None  # the header disagrees with what was written: not ours to trust
        if raw_len != want:
            return False
        off = self._data_offset(key_len)
        if not _can_sum(flags):
            return False  # summed with an algorithm this build lacks: a miss, the file stays
        if buf is not None:
            stored_view = buf[off:off + stored_len]
            if len(stored_view) != stored_len or _payload_sum([stored_view], flags) != checksum:
                return None
            if flags & FLAG_LZ4:
                return self._unpack(stored_view, raw_len, parts)
            _scatter(stored_view, parts)
            return True
        if flags & FLAG_LZ4:
            stored = os.pread(fd, stored_len, off)
            if len(stored) != stored_len or _payload_sum([stored], flags) != checksum:
                return None
            return self._unpack(stored, raw_len, parts)
        host = [p if p.device.type == "cpu" else torch.empty(p.numel(), dtype=torch.uint8) for p in parts]
        views = [memoryview(h.numpy()).cast("B") for h in host]
        got = os.preadv(fd, views, off)
        if got != stored_len or stored_len != raw_len:
            return None
        if _payload_sum(views, flags) != checksum:
            return self._reread(fd, off, stored_len, checksum, flags, parts)
        for p, h in zip(parts, host):
            if h is not p:
                p.copy_(h)
        return True

    def _reread(self, fd: int, off: int, stored_len: int, checksum: int, flags: int,
                parts: Parts) -> Optional[bool]:
        """Second look at a payload whose sum failed in the caller's buffers: a private copy decides.

        None (corrupt) only if the file itself is bad; otherwise the verified bytes
        are scattered into ``parts`` in order, as a read with private buffers would.
        """
        data = bytearray(stored_len)
        if os.preadv(fd, [data], off) != stored_len or _payload_sum([data], flags) != checksum:
            return None
        self._count("rereads")
        _scatter(memoryview(data), parts)
        return True

    def _unpack(self, stored, raw_len: int, parts: Parts) -> Optional[bool]:
        import lz4.block

        try:
            raw = lz4.block.decompress(stored, uncompressed_size=raw_len, return_bytearray=True)
        except Exception:  # lz4 raises its own error types on malformed input
            return None
        if len(raw) != raw_len:
            return None
        _scatter(memoryview(raw), parts)
        return True

    def _forget(self, key: str) -> None:
        with self._lock:
            obj = self._objects.pop(key, None)
            if obj is not None:
                self._used -= obj[1]

    def _count(self, what: str) -> None:
        with self._lock:
            self._counters[what] += 1

    # -- persistence ----------------------------------------------------------------
    def recover(self) -> list[tuple[str, int]]:
        """Rebuild the index from disk; sweep temp files and unreadable headers."""
        found: list[tuple[str, int, float]] = []
        for shard in sorted(os.listdir(self.path)):
            sdir = os.path.join(self.path, shard)
            if not os.path.isdir(sdir):
                continue
            for fname in os.listdir(sdir):
                fpath = os.path.join(sdir, fname)
                if fname.startswith(TMP_PREFIX):
                    _unlink_quiet(fpath)
                    self._counters["swept_temp"] += 1
                    continue
                if not fname.endswith(SUFFIX):
                    continue
                meta = self._read_header(fpath)
                if meta is None:
                    self._counters["corrupt"] += 1
                    _unlink_quiet(fpath)
                    continue
                key, raw_len, size, mtime = meta
                if _file_name(key) != fname:
                    self._counters["corrupt"] += 1
                    _unlink_quiet(fpath)
                    continue
                found.append((key, raw_len, mtime))
                with self._lock:
                    self._objects[key] = (raw_len, size)
                    self._used += size
        found.sort(key=lambda t: t[2])  # oldest first, so recency order survives a restart
        return [(k, n) for k, n, _ in found]

    def _read_header(self, fpath: str):
        try:
            with open(fpath, "rb") as f:
                head = f.read(HDR_SIZE + 256)
                st = os.fstat(f.fileno())
        except OSError:
            return None
        meta = _parse_header(head)
        if meta is None:
            return None
        flags, raw_len, stored_len, _, key_len, key = meta
        if st.st_size != self._data_offset(key_len) + stored_len:
            return None  # torn
        return key, raw_len, st.st_size, st.st_mtime

    def flush(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        dirs = set()
        for key in dirty:
            path = self._obj_path(key)
            try:
                _fsync_path(path)
                dirs.add(os.path.dirname(path))
            except FileNotFoundError:
                pass
            except OSError as e:
                self._count("io_errors")
                log.warning("tier %s: fsync of %s failed: %s", self.name, key[:16], e)
        for d in dirs | {self.path}:  # the renames live in the directories
            try:
                _fsync_path(d)
            except OSError:
                pass

    @property
    def used_bytes(self) -> int:
        return self._used

    def extra_stats(self) -> dict[str, Any]:
        with self._lock:
            return {"path": self.path, "objects": len(self._objects), "compression": self.compression or "none",
                    "checksum": self.checksum,
                    **self._counters}

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._pool.shutdown(wait=True)
        super().close()


def _parse_header(head: bytes):
    """(flags, raw_len, stored_len, checksum, key_len, key) of a valid header, else None."""
    if len(head) < HDR_SIZE:
        return None
    magic, version, flags, raw_len, stored_len, checksum, key_len = _HDR.unpack_from(head, 0)
    if magic != MAGIC or version != VERSION or len(head) < HDR_SIZE + key_len:
        return None
    kb = head[HDR_SIZE:HDR_SIZE + key_len]
    fixed = bytearray(head[:HDR_SIZE])
    fixed[_HDR.size:_HDR.size + _CHECK.size] = bytes(_CHECK.size)  # the check covers the header with itself zeroed
    if _CHECK.unpack_from(head, _HDR.size)[0] != _checksum([fixed, kb]):
        return None
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        return None
    return flags, raw_len, stored_len, checksum, key_len, key


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, bufs: list) -> None:
    """writev until every byte is written (writev may write less than asked)."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _scatter(src, parts: Parts) -> None:
    """Copy a host byte buffer into the caller's parts."""
    arr = torch.from_numpy(np.frombuffer(src, dtype=np.uint8))
    pos = 0
    for p in parts:
        n = p.numel()
        host_copy(p, arr[pos:pos + n])
        pos += n


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
