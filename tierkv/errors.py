"""The errors tierkv raises.

Normal life (a miss, a full tier, a backend that is down, a checksum that does
not match) is never an exception: those are values (``False``, a short count)
and counters in ``stats()``.  Exceptions are for misuse, and their message names
the problem.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the name tierkv is published under on the package index (the import name stays ``tierkv``; the index's
#: ``tierkv`` and ``tierkv-core`` are another project's)
DISTRIBUTION = "tierkv-store"


class TierKVError(Exception):
    """Base class of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A configuration names an unknown medium or policy, or a bad value."""


class BufferSizeError(TierKVError, ValueError):
    """A caller's buffer does not match the size of the chunk it is meant for."""


class StoreClosedError(TierKVError, RuntimeError):
    """The store (or tier) was used after ``close()``."""


class PolicyError(TierKVError, RuntimeError):
    """A policy broke its contract (for example named a protected key as victim)."""


def call_policy_hook(policy: object, hook: str, tier: object, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, the hook ``hook`` of ``policy`` asked about tier ``tier``: a ``PolicyError`` passes
    through; any other exception becomes a ``PolicyError`` naming the policy, the hook and the tier (a
    user's policy class never crashes the store with an error that does not say whose it is)."""
    try:
        return fn(*args)
    except PolicyError:
        raise
    except Exception as e:
        raise PolicyError(f"{type(policy).__name__}.{hook} raised for tier {tier!r}: "
                          f"{type(e).__name__}: {str(e)[:200]}") from e


def checkout_root() -> str | None:
    """The source checkout tierkv runs from (an editable install), or None for an installed package."""
    root = Path(__file__).resolve().parent.parent
    try:
        text = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return str(root) if f'name = "{DISTRIBUTION}"' in text else None


def install_hint(extra: str, root: str | None = None) -> str:
    """The command that installs tierkv's optional ``extra``: from the checkout tierkv runs from, if any.

    ``root``: a checkout to name ("" for none; default: ``checkout_root()``).
    """
    root = checkout_root() if root is None else root
    if root:
        return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
    return f"pip install '{DISTRIBUTION}[{extra}]'"
