"""tierkv: a tiered, content-addressed KV-cache store.

>>> from tierkv import TieredStore, chunk_keys
>>> store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
"""

from tierkv.errors import BufferSizeError, ConfigError, PolicyError, StoreClosedError, TierKVError
from tierkv.keys import chunk_keys, keys_from_block_hashes, namespace_root
from tierkv.units import parse_size


def __getattr__(name: str):
    # the store (and torch under it) loads on first use: `tierkv --help` and the trace tools start fast
    if name in ("TieredStore", "Level", "Lease", "PutOutcome"):
        from tierkv import store

        return getattr(store, name)
    if name == "MissReason":
        from tierkv.outcome import MissReason

        return MissReason
    if name == "FlushResult":
        from tierkv.durability import FlushResult

        return FlushResult
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")


__version__ = "0.2.0.dev0"

__all__ = [
    "BufferSizeError",
    "ConfigError",
    "FlushResult",
    "Lease",
    "Level",
    "MissReason",
    "PolicyError",
    "PutOutcome",
    "StoreClosedError",
    "TierKVError",
    "TieredStore",
    "chunk_keys",
    "keys_from_block_hashes",
    "namespace_root",
    "parse_size",
]
