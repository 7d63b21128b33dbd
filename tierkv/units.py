"""Parsing human sizes such as ``"256MiB"`` or ``"1.5GB"``."""

from __future__ import annotations

import re
from fractions import Fraction

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


#: the largest size taken: 2**63 - 1 bytes (what a signed 64-bit offset can address)
MAX_SIZE = (1 << 63) - 1
_SHOWN = 40  # characters of a bad value shown in an error


def _shown(value: object) -> str:
    r = repr(value)
    return r if len(r) <= _SHOWN else f"{r[:_SHOWN]}... ({len(r)} chars)"


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from an int or a string like ``"512MiB"``; raises ``ConfigError`` naming ``what``.

    A size is a whole number of bytes from 1 to ``MAX_SIZE``: ``"1.5KiB"`` is 1536, while
    ``"1.5"`` or ``"1.5B"`` (a fraction of a byte) is an error, never rounded."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {_shown(value)}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"{what}: cannot parse size {_shown(value)} "
                              "(examples: 1048576, '256MiB', '2GiB', '1.5GB')")
        exact = Fraction(m.group(1)) * _UNITS[unit]
        if exact.denominator != 1:
            raise ConfigError(f"{what}: size {_shown(value)} is not a whole number of bytes")
        n = int(exact)
    else:
        raise ConfigError(f"{what}: expected a size, got {_shown(value)}")
    if n <= 0:
        raise ConfigError(f"{what}: size must be positive, got {_shown(value)}")
    if n > MAX_SIZE:
        raise ConfigError(f"{what}: size {_shown(value)} is larger than the most a store takes "
                          f"({MAX_SIZE} bytes)")
    return n
