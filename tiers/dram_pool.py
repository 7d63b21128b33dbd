"""``dram_pool``: kept for imports of ``tierkv.tiers.dram_pool``; the medium lives in ``tierkv.tiers.remote``."""

from .remote.media import DramPoolTier
from .remote.options import pop_remote_options
from .remote.pool import RemotePoolTier

__all__ = ["DramPoolTier", "RemotePoolTier", "pop_remote_options"]
