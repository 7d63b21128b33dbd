"""Read-only views of what tiers hold on disk or in a pool, for ``tierkv inspect``.

``inspect_dir(path, verify, repair)`` describes an SSD tier's directory: the
log-structured engine's (``tierkv.tiers.ssd.inspect_dir``, the authority, which refuses
a directory holding no tier's data), or the former one-file-per-object layout, read
here (``<shard>/<name>.kv`` files with a 64-byte header).  Either way the answer has
the keys ``path, layout, regions (list of {index, objects, live_bytes, size_bytes}),
objects, bytes, corrupt (a list: each entry names its ``key`` or ``file`` and the
``reason``), repaired, checkpoint, checked``.  Nothing is written unless ``repair``.

``inspect_pool(master, ...)`` counts tierkv's objects in a Mooncake pool through
the master's HTTP endpoint (``/get_all_keys``, ``/batch_query_keys``): the client API
has no listing call.
"""

from __future__ import annotations

import json
import os
import re
import struct
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Optional

import xxhash

from tierkv.errors import ConfigError

# the one-file-per-object format (tiers/ssd.py): read here without importing the medium
_MAGIC = b"TKV1"
_HDR = struct.Struct("<4sHHQQQH")
_CHECK = struct.Struct("<Q")
_HDR_SIZE = 64
_DIRECT_OFFSET = 4096
_FLAG_CRC32C = 2
_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp."


def inspect_dir(path: str, verify: bool = False, repair: bool = False,
                progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Describe an SSD tier's directory (see the module docstring); a ``ConfigError`` when ``path`` is no
    directory or holds no tier's data (nothing is read or written then)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: not a directory")
    if _old_layout(path):
        return _inspect_files(path, verify, repair)
    from tierkv.tiers.ssd import inspect_dir as native

    info = dict(native(path, verify=verify, repair=repair, progress=progress))
    info["corrupt"] = list(info.get("corrupt_objects", []))  # (each names its key or its file, and why)
    return info


def _old_layout(path: str) -> bool:
    """Whether ``path`` holds the one-file-per-object layout (``*.kv`` files in two-hex-digit shards)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    for n in names:
        p = os.path.join(path, n)
        if len(n) == 2 and os.path.isdir(p):
            try:
                if any(f.endswith(_SUFFIX) or f.startswith(_TMP_PREFIX) for f in os.listdir(p)):
                    return True
            except OSError:
                continue
    return False


def _parse_header(head: bytes) -> Optional[tuple]:
    if len(head) < _HDR_SIZE:
        return None
    magic, version, flags, raw_len, stored_len, checksum, key_len = _HDR.unpack_from(head, 0)
    if magic != _MAGIC or version != 1 or len(head) < _HDR_SIZE + key_len:
        return None
    kb = head[_HDR_SIZE:_HDR_SIZE + key_len]
    fixed = bytearray(head[:_HDR_SIZE])
    fixed[_HDR.size:_HDR.size + _CHECK.size] = bytes(_CHECK.size)
    h = xxhash.xxh3_64()
    h.update(bytes(fixed))
    h.update(kb)
    if _CHECK.unpack_from(head, _HDR.size)[0] != h.intdigest():
        return None
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        return None
    return flags, raw_len, stored_len, checksum, key_len, key


def _payload_ok(data: bytes, flags: int, checksum: int) -> Optional[bool]:
    if flags & _FLAG_CRC32C:
        try:
            import crc32c
        except ImportError:
            return None  # cannot tell
        return crc32c.crc32c(data) == checksum
    return xxhash.xxh3_64_intdigest(data) == checksum


def _check_file(fpath: str, verify: bool) -> tuple[Optional[dict], Optional[str]]:
    """(object info, None) or (None, why it is corrupt)."""
    try:
        with open(fpath, "rb") as f:
            head = f.read(_HDR_SIZE + 256)
            size = os.fstat(f.fileno()).st_size
            meta = _parse_header(head)
            if meta is None:
                return None, "bad header"
            flags, raw_len, stored_len, checksum, key_len, key = meta
            if size == _HDR_SIZE + key_len + stored_len:
                off = _HDR_SIZE + key_len
            elif size == _DIRECT_OFFSET + stored_len:
                off = _DIRECT_OFFSET
            else:
                return None, f"torn: {size} bytes, header says {stored_len} stored"
            if verify:
                f.seek(off)
                ok = _payload_ok(f.read(stored_len), flags, checksum)
                if ok is False:
                    return None, "checksum mismatch"
    except OSError as e:
        return None, f"unreadable: {e}"
    return {"key": key, "raw_len": raw_len, "stored_len": stored_len, "size": size,
            "compressed": bool(flags & 1)}, None


def _inspect_files(path: str, verify: bool, repair: bool) -> dict[str, Any]:
    regions: list[dict] = []
    corrupt: list[dict] = []
    removed: list[dict] = []
    temp_files = objects = live = 0
    for shard in sorted(os.listdir(path)):
        sdir = os.path.join(path, shard)
        if not os.path.isdir(sdir):
            continue
        n = sbytes = disk = 0
        for fname in sorted(os.listdir(sdir)):
            fpath = os.path.join(sdir, fname)
            if fname.startswith(_TMP_PREFIX):
                temp_files += 1
                if repair and _unlink(fpath):
                    removed.append({"file": os.path.relpath(fpath, path), "reason": "stray temporary file"})
                continue
            if not fname.endswith(_SUFFIX):
                continue
            obj, why = _check_file(fpath, verify)
            try:
                st = os.stat(fpath)
                disk += st.st_blocks * 512
            except OSError:
                pass
            if obj is None:
                entry = {"file": os.path.relpath(fpath, path), "reason": why}
                if repair and _unlink(fpath):
                    removed.append(entry)
                else:
                    corrupt.append(entry)  # (after a repair: what could not be removed)
                continue
            n += 1
            sbytes += obj["raw_len"]
        try:
            index = int(shard, 16)
        except ValueError:
            index = len(regions)
        regions.append({"index": index, "name": shard, "objects": n, "live_bytes": sbytes, "size_bytes": disk})
        objects += n
        live += sbytes
    return {"path": path, "layout": "files", "regions": regions, "objects": objects, "bytes": live,
            "corrupt": corrupt, "repaired": len(removed), "checkpoint": None, "temp_files": temp_files,
            "verified": verify, "checked": ["every file's header and size"] + (["payload sums"] if verify else []),
            "removed": removed}


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def inspect_pool(master: str, metrics_port: int = 9003, namespace: str = "tierkv") -> dict[str, Any]:
    """tierkv's objects and bytes in a Mooncake pool, per medium tag (``<namespace>/<tag>/<key>``)."""
    host = master.rsplit(":", 1)[0] if ":" in master else master
    base = f"http://{host}:{metrics_port}"
    try:
        listing = _http_get(f"{base}/get_all_keys")
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError(f"cannot list keys at the master's HTTP endpoint {base}/get_all_keys "
                          f"(its --metrics_port; give --metrics-port): {e}") from e
    keys = [k.strip() for k in listing.replace(",", "\n").splitlines() if k.strip()]
    prefix = namespace.rstrip("/") + "/"
    ours = [k for k in keys if k.startswith(prefix) and not k.startswith(prefix + "sentinel/")]
    by_tag: dict[str, dict[str, int]] = {}
    notes = []
    sizes = _query_sizes(base, ours)
    total = 0
    for k in ours:
        tag = k[len(prefix):].split("/", 1)[0]
        d = by_tag.setdefault(tag, {"objects": 0, "bytes": 0})
        d["objects"] += 1
        n = sizes.get(k)
        if n is not None:
            d["bytes"] += n
            total += n
    if len(sizes) < len(ours):
        notes.append(f"sizes known for {len(sizes)} of {len(ours)} objects (the others were gone or unreadable "
                     "when asked)")
    return {"master": master, "namespace": namespace, "objects": len(ours), "bytes": total, "by_tag": by_tag,
            "pool_keys": len(keys), "notes": notes}


_PLAIN = re.compile(r"^[A-Za-z0-9._/-]+$")  # keys the master's HTTP endpoint takes unescaped


def _query_sizes(base: str, keys: list[str], batch: int = 64) -> dict[str, int]:
    """Object size per key from ``/batch_query_keys`` (one replica's ``size_``)."""
    out: dict[str, int] = {}
    plain = [k for k in keys if _PLAIN.match(k)]
    for i in range(0, len(plain), batch):
        part = plain[i:i + batch]
        try:
            doc = json.loads(_http_get(f"{base}/batch_query_keys?keys={','.join(part)}"))
        except (urllib.error.URLError, OSError, json.JSONDecodeError):
            continue
        for k, v in ((doc or {}).get("data") or {}).items():
            vals = (v or {}).get("values") or []
            if (v or {}).get("ok") and vals and isinstance(vals[0].get("size_"), int):
                out[k] = vals[0]["size_"]
    return out
