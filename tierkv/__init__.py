"""tierkv: a tiered, content-addressed KV-cache store.

>>> from tierkv import TieredStore, chunk_keys
>>> store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
"""

from tierkv.errors import BufferSizeError, ConfigError, PolicyError, StoreClosedError, TierKVError
from tierkv.keys import chunk_keys, keys_from_block_hashes, namespace_root
from tierkv.level import Level
from tierkv.store import PutOutcome, TieredStore
from tierkv.units import parse_size

__version__ = "0.2.0.dev0"

__all__ = [
    "TieredStore", "Level", "PutOutcome", "chunk_keys", "keys_from_block_hashes", "namespace_root", "parse_size",
    "TierKVError", "ConfigError", "BufferSizeError", "StoreClosedError", "PolicyError",
]
