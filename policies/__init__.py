"""Policies that steer the store: eviction, promotion and admission.

Each kind has a base class to subclass (the customisation path) and built-ins
selected by name in a config.  ``build_*`` turn a config value (a name, a dict
with ``"policy"`` and parameters, an instance, or ``"package.module:Class"``)
into an instance.
"""

from __future__ import annotations

from typing import Any

from tierkv.errors import ConfigError

from .admission import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    AdmitAll,
    AdmitNone,
    AllOf,
    FrequencyAdmission,
    SizeAdmission,
)
from .arc import ARCPolicy
from .eviction import EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy
from .promotion import PROMOTION_POLICIES, NeverPromote, PromoteOnHit, PromotionPolicy
from .s3fifo import S3FIFOPolicy

#: eviction policy name -> class (the scan-resistant built-ins have modules of their own over eviction.py's base)
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "s3fifo": S3FIFOPolicy,
    "s3-fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
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
    elif isinstance(spec, str) and ":" in spec:
        from tierkv.tiers import load_object

        cls = load_object(spec, f"{kind} policy")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"{kind} policy {spec!r} is not a subclass of {base.__name__}")
    else:
        raise ConfigError(
            f"unknown {kind} policy {spec!r}; known: {sorted(table)}, an instance, or 'package.module:Class'"
        )
    try:
        return cls(**params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{kind} policy {getattr(cls, 'name', cls.__name__)!r}: bad parameters {params!r}: {e}") from e


def build_eviction(spec: Any) -> EvictionPolicy:
    return _build("eviction", EvictionPolicy, EVICTION_POLICIES, spec, "lru")


def build_promotion(spec: Any) -> PromotionPolicy:
    return _build("promotion", PromotionPolicy, PROMOTION_POLICIES, spec, "on-hit")


def build_admission(spec: Any) -> AdmissionPolicy:
    return _build("admission", AdmissionPolicy, ADMISSION_POLICIES, spec, "always")


__all__ = [
    "ADMISSION_POLICIES",
    "EVICTION_POLICIES",
    "PROMOTION_POLICIES",
    "ARCPolicy",
    "AdmissionPolicy",
    "AdmitAll",
    "AdmitNone",
    "AllOf",
    "EvictionPolicy",
    "FIFOPolicy",
    "FrequencyAdmission",
    "LFUPolicy",
    "LRUPolicy",
    "NeverPromote",
    "PromoteOnHit",
    "PromotionPolicy",
    "S3FIFOPolicy",
    "SizeAdmission",
    "build_admission",
    "build_eviction",
    "build_promotion",
]
