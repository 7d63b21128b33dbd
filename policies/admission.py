"""Admission policies: whether a tier accepts a chunk at all.

The store asks ``decide(key, nbytes, tier)`` before it places a chunk in a tier (on put, demotion,
promotion or a write-behind copy) and gets an ``Admission``: ``ADMIT``, ``REJECT`` (the chunk goes on to
the next tier) or ``THROTTLED`` (the tier would take it, but not now: it goes on too, counted apart).
``decide`` is the checked public method: it calls the policy's ``admit`` hook, accepts ``True`` /
``False`` or an ``Admission``, and turns anything else, or an exception, into a ``PolicyError`` naming the
policy.  ``on_access(key)`` is called for every put and get of the key, so a policy can count demand
(``observes_demand`` says whether it needs to be).

Policies compose: ``AllOf(a, b)`` (``"all-of"``) admits what every member admits, ``AnyOf(a, b)``
(``"any-of"``) what some member admits.  ``admits_everything`` tells the store it may skip asking.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Union, final

from tierkv.errors import ConfigError, PolicyError, call_policy_hook
from tierkv.options import check_int, short
from tierkv.outcome import Admission
from tierkv.units import parse_size

#: what an ``admit`` hook may return
Answer = Union[bool, Admission]


class AdmissionPolicy:
    """Base class: override ``admit`` (and ``on_access`` to observe demand); the store calls ``decide``."""

    #: config name (``"admission": "frequency"``)
    name = "custom"

    @property
    def admits_everything(self) -> bool:
        """True when every chunk is admitted without asking, so the store may skip ``decide`` (and the
        batch fast paths that need no per-chunk answer stay open).  False unless a policy knows better."""
        return False

    @property
    def observes_demand(self) -> bool:
        """True when ``on_access`` does something (a subclass overrides it): only then need the store tell it."""
        return type(self).on_access is not AdmissionPolicy.on_access

    def admit(self, key: Hashable, nbytes: int, tier: str) -> Answer:
        """The hook to override: may ``tier`` take the chunk ``key`` of ``nbytes`` bytes?

        Return ``True`` (admit), ``False`` (reject) or an ``Admission`` (``THROTTLED`` included).
        """
        raise NotImplementedError

    def on_access(self, key: Hashable) -> None:
        """The key was put or read through the store."""

    @final
    def decide(self, key: Hashable, nbytes: int, tier: str) -> Admission:
        """The answer for one chunk and tier: ``admit`` called and its answer checked (never override)."""
        answer = call_policy_hook(self, "admit", tier, self.admit, key, nbytes, tier)
        if answer is True:
            return Admission.ADMIT
        if answer is False:
            return Admission.REJECT
        if isinstance(answer, Admission):
            return answer
        raise PolicyError(f"{type(self).__name__}.admit answered {short(answer)} for tier {tier!r}: "
                          "an admission answer is True, False or an Admission")


class AdmitAll(AdmissionPolicy):
    """Admit every chunk (the default)."""

    name = "always"

    @property
    def admits_everything(self) -> bool:
        # a subclass that overrides ``admit`` is asked like any other policy
        return type(self).admit is AdmitAll.admit

    def admit(self, key, nbytes, tier):
        return True


class AdmitNone(AdmissionPolicy):
    """Admit nothing: a tier kept only for reads of what it already holds (e.g. a read-only SSD)."""

    name = "never"

    def admit(self, key, nbytes, tier):
        return False


class FrequencyAdmission(AdmissionPolicy):
    """Admit a chunk only once it has been accessed ``min_accesses`` times.

    Useful on SSD: one-off prefixes never cost a write, sparing the drive's wear.
    Counts live in a bounded LRU table of ``max_tracked`` keys.
    """

    name = "frequency"

    def __init__(self, min_accesses: int = 2, max_tracked: int = 1 << 20) -> None:
        self.min_accesses = check_int(min_accesses, "frequency admission 'min_accesses'", min_value=1)
        self.max_tracked = check_int(max_tracked, "frequency admission 'max_tracked'", min_value=1)
        self._counts: OrderedDict[Hashable, int] = OrderedDict()

    def on_access(self, key):
        n = self._counts.pop(key, 0) + 1
        self._counts[key] = n
        if len(self._counts) > self.max_tracked:
            self._counts.popitem(last=False)

    def admit(self, key, nbytes, tier):
        return self._counts.get(key, 0) >= self.min_accesses


class SizeAdmission(AdmissionPolicy):
    """Admit chunks no larger than ``max_bytes``."""

    name = "size"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = parse_size(max_bytes, "size admission 'max_bytes'")

    def admit(self, key, nbytes, tier):
        return nbytes <= self.max_bytes


class RateLimitAdmission(AdmissionPolicy):
    """Admit at most ``bytes_per_s`` bytes a second, in bursts of up to ``burst`` bytes (a token bucket).

    A chunk the bucket cannot cover now is ``THROTTLED`` (it goes on to the next tier and is counted
    apart); one larger than ``burst`` could never be covered and is ``REJECT``-ed.  Useful on SSD to cap
    the write rate a drive's endurance allows.  ``clock`` (seconds, monotonic) is for tests.
    """

    name = "rate-limit"

    def __init__(self, bytes_per_s: int | str, burst: int | str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_s = parse_size(bytes_per_s, "rate-limit admission 'bytes_per_s'")
        self.burst = self.bytes_per_s if burst is None else parse_size(burst, "rate-limit admission 'burst'")
        if not callable(clock):
            raise ConfigError(f"rate-limit admission 'clock': expected a function, got {short(clock)}")
        self._clock = clock
        self._tokens = float(self.burst)  # starts full
        self._at = clock()

    def admit(self, key, nbytes, tier):
        if nbytes > self.burst:
            return Admission.REJECT
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.bytes_per_s)
        self._at = now
        if nbytes > self._tokens:
            return Admission.THROTTLED
        self._tokens -= nbytes
        return Admission.ADMIT


class _Composite(AdmissionPolicy):
    """Members asked in order through their own ``decide``; demand is told to every member."""

    def __init__(self, *policies: AdmissionPolicy) -> None:
        if not policies:
            raise ConfigError(f"{self.name} admission needs at least one member policy")
        for p in policies:
            if not isinstance(p, AdmissionPolicy):
                raise ConfigError(f"{self.name} admission: members must be AdmissionPolicy instances, got "
                                  f"{type(p).__name__}")
        self.policies: tuple[AdmissionPolicy, ...] = tuple(policies)
        self._observers = tuple(p for p in self.policies if p.observes_demand)

    @property
    def observes_demand(self) -> bool:
        return type(self).on_access is not _Composite.on_access or bool(self._observers)

    def on_access(self, key):
        for p in self._observers:
            p.on_access(key)


class AllOf(_Composite):
    """Admit what every member admits.

    Members are asked in order and the first answer that is not ``ADMIT`` is the answer: members after
    it are not asked (put a stateful member, such as a rate limit, last, so that it spends its budget
    only on chunks the others admit).
    """

    name = "all-of"

    @property
    def admits_everything(self) -> bool:
        return type(self).admit is AllOf.admit and all(p.admits_everything for p in self.policies)

    def admit(self, key, nbytes, tier):
        for p in self.policies:
            answer = p.decide(key, nbytes, tier)
            if answer is not Admission.ADMIT:
                return answer
        return Admission.ADMIT


class AnyOf(_Composite):
    """Admit what some member admits.

    Members are asked in order until one admits; when none does, the answer is ``THROTTLED`` if some
    member throttled, else ``REJECT``.
    """

    name = "any-of"

    @property
    def admits_everything(self) -> bool:
        return type(self).admit is AnyOf.admit and any(p.admits_everything for p in self.policies)

    def admit(self, key, nbytes, tier):
        throttled = False
        for p in self.policies:
            answer = p.decide(key, nbytes, tier)
            if answer is Admission.ADMIT:
                return answer
            throttled = throttled or answer is Admission.THROTTLED
        return Admission.THROTTLED if throttled else Admission.REJECT


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    "always": AdmitAll,
    "never": AdmitNone,
    "frequency": FrequencyAdmission,
    "size": SizeAdmission,
    "rate-limit": RateLimitAdmission,
    "all-of": AllOf,
    "any-of": AnyOf,
}
