"""Admission policies: whether a tier accepts a chunk at all.

The store asks ``admit(key, nbytes, tier)`` before it places a chunk in a tier
(on put, demotion or promotion); a refusal sends the chunk on to the next tier.
``on_access(key)`` is called for every put and get of the key, so a policy can
count demand.  Policies compose: ``AllOf(a, b)`` admits what every member admits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from tierkv.errors import ConfigError
from tierkv.options import check_int
from tierkv.units import parse_size


class AdmissionPolicy:
    """Base class: override ``admit`` (and ``on_access`` to observe demand)."""

    name = "custom"

    def admit(self, key: Hashable, nbytes: int, tier: str) -> bool:
        raise NotImplementedError

    def on_access(self, key: Hashable) -> None:
        """The key was put or read through the store."""


class AdmitAll(AdmissionPolicy):
    name = "always"

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

    def __init__(self, min_accesses: int = 2, max_tracked: int = 1 << 20, *, threshold: int | None = None) -> None:
        if threshold is not None:  # an alias some configs use
            min_accesses = threshold
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


class AllOf(AdmissionPolicy):
    """Admit what every member admits."""

    name = "all-of"

    def __init__(self, *policies: AdmissionPolicy) -> None:
        for p in policies:
            if not isinstance(p, AdmissionPolicy):
                raise ConfigError(f"all-of admission: members must be AdmissionPolicy instances, got "
                                  f"{type(p).__name__}")
        self.policies = policies

    def on_access(self, key):
        for p in self.policies:
            p.on_access(key)

    def admit(self, key, nbytes, tier):
        return all(p.admit(key, nbytes, tier) for p in self.policies)


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    "always": AdmitAll,
    "never": AdmitNone,
    "frequency": FrequencyAdmission,
    "size": SizeAdmission,
}
