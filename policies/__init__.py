"""Policies that steer the store: eviction, promotion and admission.

Each kind has a base class to subclass (the customisation path) and built-ins
selected by name in a config.  ``build_*`` (``registry.py``) turn a config value
(a name, a dict with ``"policy"`` and parameters, an instance, or
``"package.module:Class"``) into an instance.
"""

from __future__ import annotations

from tierkv.outcome import Admission, AdmissionCounts

from .admission import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    AdmitAll,
    AdmitNone,
    AllOf,
    AnyOf,
    FrequencyAdmission,
    RateLimitAdmission,
    SizeAdmission,
)
from .arc import ARCPolicy
from .eviction import EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy
from .promotion import PROMOTION_POLICIES, NeverPromote, PromoteOnHit, PromotionPolicy
from .registry import EVICTION_POLICIES, build_admission, build_eviction, build_promotion
from .s3fifo import S3FIFOPolicy

__all__ = [
    "ADMISSION_POLICIES",
    "EVICTION_POLICIES",
    "PROMOTION_POLICIES",
    "ARCPolicy",
    "Admission",
    "AdmissionCounts",
    "AdmissionPolicy",
    "AdmitAll",
    "AdmitNone",
    "AllOf",
    "AnyOf",
    "EvictionPolicy",
    "FIFOPolicy",
    "FrequencyAdmission",
    "LFUPolicy",
    "LRUPolicy",
    "NeverPromote",
    "PromoteOnHit",
    "PromotionPolicy",
    "RateLimitAdmission",
    "S3FIFOPolicy",
    "SizeAdmission",
    "build_admission",
    "build_eviction",
    "build_promotion",
]
