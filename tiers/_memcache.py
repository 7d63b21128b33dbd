"""Kept for old imports: the memcache backend is ``tierkv.tiers.remote.memcache``."""

from .remote.memcache import *  # noqa: F403
from .remote.memcache import MAX_KEY_BYTES, MemcacheClient, MemcacheSettings, import_memcache  # noqa: F401
