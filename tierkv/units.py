"""Parsing human sizes such as ``"256MiB"`` or ``"1.5GB"``."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from an int or a string like ``"512MiB"``; raises ``ConfigError`` naming ``what``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"{what}: cannot parse size {value!r} (examples: 1048576, '256MiB', '2GiB', '1.5GB')")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if n <= 0:
        raise ConfigError(f"{what}: size must be positive, got {value!r}")
    return n
