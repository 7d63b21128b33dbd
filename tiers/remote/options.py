"""Options every remote tier shares, read with the typed readers of ``tierkv.options``.

Every value is checked by type: ``"1"`` is not a number of seconds and
``"false"`` is not a bool; sizes are the one exception (``"100MB"``).  Each
error is a ``ConfigError`` that names the tier and the option.
"""

from __future__ import annotations

import os
from typing import Any

from tierkv.errors import ConfigError
from tierkv.options import pop_float, pop_int, pop_size, pop_str

#: option -> default, for the seconds-valued options (all must be > 0)
SECONDS = {
    "timeout": 1.0,            # a control call's deadline (data calls add nbytes / min_bandwidth)
    "connect_timeout": 30.0,   # a client setup that takes longer is abandoned
    "connect_wait": 5.0,       # how long construction waits for the first connection
    "probe_interval": 1.0,     # health probe period while available
    "presence_ttl": 1.0,       # how long a confirmed key answers contains() without asking
    "full_retry_delay": 0.02,  # the one pause before retrying writes refused for lack of space
    "late_read_wait": 60.0,    # a read into the caller's memory past its deadline: how long the caller waits for
                               # the abandoned transfer to end (it may still write there), the miss answered after
}


def what(tier: str) -> str:
    """How errors name a tier: ``tier 'pool'``."""
    return f"tier {tier!r}"


def pop_remote_options(tier: str, options: dict[str, Any]) -> dict[str, Any]:
    """The shared options as ``RemotePoolTier`` keyword arguments."""
    w = what(tier)
    out: dict[str, Any] = {"namespace": pop_str(options, "namespace", "tierkv", w)}
    for key, default in SECONDS.items():
        out[key] = pop_float(options, key, default, w, min_value=0.0, min_exclusive=True)
    out["min_bandwidth"] = float(pop_size(options, "min_bandwidth", 100_000_000, w))
    out["register_limit"] = pop_size(options, "register_limit", 4 << 30, w)
    out["workers"] = pop_int(options, "workers", 4, w, min_value=1, max_value=64)
    return out


def pop_env_str(tier: str, options: dict[str, Any], key: str, default: str | None, env: str | None = None) -> str:
    """A required non-empty string option; the environment variable ``env``, when set, overrides it."""
    value = pop_str(options, key, default, what(tier))
    if env and os.environ.get(env):
        value = os.environ[env]
    if value is None:
        raise ConfigError(f"{what(tier)} option {key!r} is required")
    return value
