"""Promotion policies: when a chunk read from a slower tier is copied up.

``should_promote(key, src, dst)`` is asked once per hit served by tier ``src``
(a tier name) for the faster tier ``dst`` the store would copy it into.  A copy
is inclusive: the chunk stays in ``src`` too, so demoting it later costs nothing.
The store asks through ``decide``, the checked public method: an answer that is
not a ``bool``, or an exception, becomes a ``PolicyError`` naming the policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import final

from tierkv.errors import PolicyError, call_policy_hook
from tierkv.options import check_int, short


class PromotionPolicy:
    """Base class: override ``should_promote``; the store calls ``decide``."""

    name = "custom"

    def should_promote(self, key: Hashable, src: str, dst: str) -> bool:
        """The hook to override: copy ``key``, just read from tier ``src``, up into tier ``dst``?"""
        raise NotImplementedError

    @final
    def decide(self, key: Hashable, src: str, dst: str) -> bool:
        """Whether to promote: ``should_promote`` called and its answer checked (never override)."""
        answer = call_policy_hook(self, "should_promote", src, self.should_promote, key, src, dst)
        if answer is True or answer is False:
            return answer
        raise PolicyError(f"{type(self).__name__}.should_promote answered {short(answer)} for tier {src!r}: "
                          "a promotion answer is True or False")

    def on_remove(self, key: Hashable) -> None:
        """The chunk left the store entirely (optional hook)."""


class NeverPromote(PromotionPolicy):
    """Chunks stay where they are."""

    name = "never"

    def should_promote(self, key, src, dst):
        return False


class PromoteOnHit(PromotionPolicy):
    """Promote once a chunk has been hit ``min_hits`` times below the top tier.

    Hit counts live in a bounded LRU table (``max_tracked`` keys), so a stream of
    one-off keys cannot grow memory without bound.
    """

    name = "on-hit"

    def __init__(self, min_hits: int = 1, max_tracked: int = 1 << 20) -> None:
        self.min_hits = check_int(min_hits, "on-hit promotion 'min_hits'", min_value=1)
        self.max_tracked = check_int(max_tracked, "on-hit promotion 'max_tracked'", min_value=1)
        self._hits: OrderedDict[Hashable, int] = OrderedDict()

    def should_promote(self, key, src, dst):
        if self.min_hits == 1:
            return True
        n = self._hits.pop(key, 0) + 1
        if n >= self.min_hits:
            return True
        self._hits[key] = n
        if len(self._hits) > self.max_tracked:
            self._hits.popitem(last=False)
        return False

    def on_remove(self, key):
        self._hits.pop(key, None)


PROMOTION_POLICIES: dict[str, type[PromotionPolicy]] = {
    "never": NeverPromote,
    "on-hit": PromoteOnHit,
}
