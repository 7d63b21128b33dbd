"""``remote_npu``: kept for imports of ``tierkv.tiers.remote_npu``; the medium lives in ``tierkv.tiers.remote``."""

from .remote.media import RemoteNPUTier

__all__ = ["RemoteNPUTier"]
