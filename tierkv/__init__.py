"""tierkv: a tiered, content-addressed KV-cache store.

>>> from tierkv import TieredStore, chunk_keys
>>> store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
"""

from tierkv.errors import BufferSizeError, ConfigError, PolicyError, StoreClosedError, TierKVError
from tierkv.keys import chunk_keys, keys_from_block_hashes, namespace_root
from tierkv.store import Level, TieredStore
from tierkv.units import parse_size

__version__ = "0.1.0"

__all__ = [
    "TieredStore", "Level", "chunk_keys", "keys_from_block_hashes", "namespace_root", "parse_size",
    "TierKVError", "ConfigError", "BufferSizeError", "StoreClosedError", "PolicyError",
]
