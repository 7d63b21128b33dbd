"""Calling a policy's hooks: errors named after the policy, and when a batch hook may stand for a loop.

Every call the store and its levels make into a user's policy goes through
``call_policy``, so a hook that raises surfaces as one ``PolicyError`` that names
the policy class, the hook and the tier, whatever the policy raised.
"""

from __future__ import annotations

from typing import Any, Optional

from tierkv.errors import PolicyError


def call_policy(policy: Any, hook: str, tier: str, *args: Any) -> Any:
    """Call a policy hook; any exception it raises becomes a ``PolicyError`` naming policy, hook and tier."""
    try:
        return getattr(policy, hook)(*args)
    except PolicyError:
        raise
    except Exception as e:
        raise PolicyError(f"{type(policy).__name__}.{hook} raised for tier {tier!r}: "
                          f"{type(e).__name__}: {str(e)[:200]}") from e


def batch_hook(policy: Any, single: str, many: str) -> bool:
    """Whether ``policy.many`` may stand for a loop over ``policy.single``.

    Only when the class that defines the batch hook is the one that defines the single
    hook, or derives from it: a subclass that overrides ``on_insert`` of a built-in
    policy, but not its ``on_insert_many``, must still have its override called.
    """
    if policy is None:
        return False

    def owner(name: str) -> Optional[type]:
        for k in type(policy).__mro__:
            if name in k.__dict__:
                return k
        return None

    o_many, o_single = owner(many), owner(single)
    return o_many is not None and o_single is not None and issubclass(o_many, o_single)
