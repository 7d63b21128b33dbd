"""The built-in policies by config name, and the builders that turn a config value into a policy.

A config value is a name (``"lru"``), a dict with ``"policy"`` and parameters, an instance, a class, or
``"package.module:Class"``.  The composite admissions take their members as ``"policies"``, a list of such
values: ``{"policy": "all-of", "policies": ["frequency", {"policy": "size", "max_bytes": "1MiB"}]}``.

Each concept has one spelling: a spelling that was dropped is refused with a ``ConfigError`` naming the
one to use (``REMOVED_NAMES``, ``REMOVED_PARAMETERS``).  This module imports every policy module; none
of them imports it, so the policies form no import cycle.
"""

from __future__ import annotations

from typing import Any

from tierkv.errors import ConfigError

from .admission import ADMISSION_POLICIES, AdmissionPolicy, FrequencyAdmission, _Composite
from .arc import ARCPolicy
from .eviction import EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy
from .promotion import PROMOTION_POLICIES, PromotionPolicy
from .s3fifo import S3FIFOPolicy

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
}

#: kind -> {removed policy name: the name to use}
REMOVED_NAMES: dict[str, dict[str, str]] = {
    "eviction": {"s3-fifo": "s3fifo"},
    "promotion": {"on_hit": "on-hit"},
    "admission": {},
}

#: policy class -> {removed parameter: the parameter to use}
REMOVED_PARAMETERS: dict[type, dict[str, str]] = {
    FrequencyAdmission: {"threshold": "min_accesses"},
}


def _build(kind: str, base: type, table: dict[str, type], spec: Any, default: str) -> Any:
    if spec is None:
        spec = default
    if isinstance(spec, base):
        return spec
    params: dict[str, Any] = {}
    if isinstance(spec, dict):
        params = dict(spec)
        spec = params.pop("policy", None)
        if spec is None:
            raise ConfigError(f"{kind} policy config {params!r} lacks a 'policy' name")
    if isinstance(spec, type) and issubclass(spec, base):
        cls = spec
    elif isinstance(spec, str) and spec.lower() in table:
        cls = table[spec.lower()]
    elif isinstance(spec, str) and spec.lower() in REMOVED_NAMES[kind]:
        raise ConfigError(f"{kind} policy {spec!r} is no longer a name: use "
                          f"{REMOVED_NAMES[kind][spec.lower()]!r}")
    elif isinstance(spec, str) and ":" in spec:
        from tierkv.tiers import load_object

        cls = load_object(spec, f"{kind} policy")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"{kind} policy {spec!r} is not a subclass of {base.__name__}")
    else:
        raise ConfigError(
            f"unknown {kind} policy {spec!r}; known: {sorted(table)}, an instance, or 'package.module:Class'"
        )
    label = getattr(cls, "name", cls.__name__)
    for old, new in REMOVED_PARAMETERS.get(cls, {}).items():
        if old in params:
            raise ConfigError(f"{kind} policy {label!r}: parameter {old!r} is no longer accepted: use {new!r}")
    members: list[Any] = []
    if isinstance(cls, type) and issubclass(cls, _Composite):
        given = params.pop("policies", None)
        if not isinstance(given, (list, tuple)) or not given:
            raise ConfigError(f"{kind} policy {label!r} needs 'policies': a non-empty list of admission "
                              f"policies, got {given!r}")
        members = [build_admission(m) for m in given]
    try:
        return cls(*members, **params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{kind} policy {label!r}: bad parameters {params!r}: {e}") from e


def build_eviction(spec: Any) -> EvictionPolicy:
    """An eviction policy from a config value (default ``"lru"``)."""
    return _build("eviction", EvictionPolicy, EVICTION_POLICIES, spec, "lru")


def build_promotion(spec: Any) -> PromotionPolicy:
    """A promotion policy from a config value (default ``"on-hit"``)."""
    return _build("promotion", PromotionPolicy, PROMOTION_POLICIES, spec, "on-hit")


def build_admission(spec: Any) -> AdmissionPolicy:
    """An admission policy from a config value (default ``"always"``)."""
    return _build("admission", AdmissionPolicy, ADMISSION_POLICIES, spec, "always")
