"""Read-only views of what tiers hold on disk or in a pool, for ``tierkv inspect``.

``inspect_dir(path, verify, repair)`` describes an SSD tier's directory through the
log-structured engine's own reader (``tierkv.tiers.ssd.inspect_dir``, the authority,
which refuses a directory holding no tier's data), adding ``corrupt``: a list whose
entries name their ``key`` or ``file`` and the ``reason``.  Nothing is written unless
``repair``.

``inspect_pool(master, ...)`` counts tierkv's objects in a Mooncake pool through
the master's HTTP endpoint (``/get_all_keys``, ``/batch_query_keys``): the client API
has no listing call.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Optional

from tierkv.errors import ConfigError


def inspect_dir(path: str, verify: bool = False, repair: bool = False,
                progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Describe an SSD tier's directory (see the module docstring); a ``ConfigError`` when ``path`` is no
    directory or holds no tier's data (nothing is read or written then)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: not a directory")
    from tierkv.tiers.ssd import inspect_dir as native

    info = dict(native(path, verify=verify, repair=repair, progress=progress))
    info["corrupt"] = list(info.get("corrupt_objects", []))  # (each names its key or its file, and why)
    return info


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
