"""Typed option readers: every config value is checked by type, with an error that names it.

Each ``pop_*`` removes one option from a config mapping and returns it checked;
a missing option gives ``default``.  Strings are never coerced: ``"false"`` is
not ``False`` and ``"8"`` is not ``8`` (sizes are the exception: ``"2GiB"`` is
how sizes are written).  ``what`` names the option in the message, e.g.
``"tier 'ssd' option 'direct_io'"``.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Collection, MutableMapping
from typing import Any, Optional, TypeVar

from tierkv.errors import ConfigError
from tierkv.units import parse_size

_MISSING: Any = object()
E = TypeVar("E", bound=enum.Enum)


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error never embeds a huge value."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 5] + "...'" + f" ({len(r)} chars)"


def check_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{what}: expected true or false, got {short(value)} ({type(value).__name__})")


def check_int(value: Any, what: str, *, min_value: Optional[int] = None, max_value: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(f"{what}: expected an integer, got {short(value)} ({type(value).__name__})")
    if min_value is not None and value < min_value:
        raise ConfigError(f"{what}: must be at least {min_value}, got {short(value)}")
    if max_value is not None and value > max_value:
        raise ConfigError(f"{what}: must be at most {max_value}, got {short(value)}")
    return int(value)


def check_float(value: Any, what: str, *, min_value: Optional[float] = None, max_value: Optional[float] = None,
                min_exclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what}: expected a number, got {short(value)} ({type(value).__name__})")
    try:
        v = float(value)
    except OverflowError:  # an int too large for a float
        raise ConfigError(f"{what}: expected a finite number, got {short(value)}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ConfigError(f"{what}: expected a finite number, got {short(value)}")
    if min_value is not None and (v < min_value or (min_exclusive and v == min_value)):
        raise ConfigError(f"{what}: must be {'>' if min_exclusive else '>='} {min_value}, got {short(value)}")
    if max_value is not None and v > max_value:
        raise ConfigError(f"{what}: must be at most {max_value}, got {short(value)}")
    return v


def check_str(value: Any, what: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a string, got {short(value)} ({type(value).__name__})")
    if not allow_empty and not value:
        raise ConfigError(f"{what}: must not be empty")
    return value


def check_choice(value: Any, what: str, choices: Collection[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{what}: expected one of {sorted(choices)}, got {short(value)}")
    return value


def check_enum(value: Any, what: str, kind: type[E]) -> E:
    """A member of the enum ``kind``, given as a member or as its value (the config spelling)."""
    if isinstance(value, kind):
        return value
    for member in kind:
        if type(value) is str and value == member.value:
            return member
    raise ConfigError(f"{what}: expected one of {sorted(str(m.value) for m in kind)}, got {short(value)}")


def _pop(options: MutableMapping[str, Any], key: str, default: Any) -> Any:
    if not isinstance(options, MutableMapping):
        raise ConfigError(f"options must be a mapping, got {type(options).__name__}")
    return options.pop(key, default)


def pop_bool(options: MutableMapping[str, Any], key: str, default: Any, what: str) -> Any:
    v = _pop(options, key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        return default
    return check_bool(v, f"{what} option {key!r}")


def pop_int(options: MutableMapping[str, Any], key: str, default: Any, what: str, **bounds: Any) -> Any:
    v = _pop(options, key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        return default
    return check_int(v, f"{what} option {key!r}", **bounds)


def pop_float(options: MutableMapping[str, Any], key: str, default: Any, what: str, **bounds: Any) -> Any:
    v = _pop(options, key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        return default
    return check_float(v, f"{what} option {key!r}", **bounds)


def pop_str(options: MutableMapping[str, Any], key: str, default: Any, what: str, **kw: Any) -> Any:
    v = _pop(options, key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        return default
    return check_str(v, f"{what} option {key!r}", **kw)


def pop_choice(options: MutableMapping[str, Any], key: str, default: Any, what: str,
               choices: Collection[str]) -> Any:
    v = _pop(options, key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        return default
    return check_choice(v, f"{what} option {key!r}", choices)


def pop_enum(options: MutableMapping[str, Any], key: str, default: Any, what: str, kind: type[E]) -> Any:
    """A member of the enum ``kind``, written as its value (``"write_through"``)."""
    v = _pop(options, key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        return default
    return check_enum(v, f"{what} option {key!r}", kind)


def pop_size(options: MutableMapping[str, Any], key: str, default: Any, what: str) -> Any:
    """A positive byte count: an int, or a string such as ``"256MiB"``."""
    v = _pop(options, key, _MISSING)
    if v is _MISSING or (v is None and default is None):
        return default
    return parse_size(v, f"{what} option {key!r}")


def pop_store_config(options: MutableMapping[str, Any], what: str, default: Any) -> Any:
    """An engine adapter's store config: inline under ``"tierkv"`` (a mapping, or a JSON string, which
    survives shell quoting) or a file path under ``"tierkv_config_file"``; with neither, ``default``.
    Both keys are removed from ``options``; giving both is an error."""
    inline = options.pop("tierkv", None)
    path = options.pop("tierkv_config_file", None)
    if inline is not None and path is not None:
        raise ConfigError(f"{what}: give either 'tierkv' or 'tierkv_config_file', not both")
    if inline is not None:
        if isinstance(inline, str):
            try:
                inline = json.loads(inline)
            except ValueError as e:
                raise ConfigError(f"{what} option 'tierkv' is not valid JSON: {e}") from e
        if not isinstance(inline, dict):
            raise ConfigError(f"{what} option 'tierkv': expected a store config (a mapping), "
                              f"got {type(inline).__name__}")
        return inline
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{what} option 'tierkv_config_file': expected a file path, got {short(path)}")
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise ConfigError(f"{what} option 'tierkv_config_file': {path!r} does not exist")
        return path
    return default
