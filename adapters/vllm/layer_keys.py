"""Store keys of the connector's objects: one key per (chunk, layer, KV-head shard), each one SHA-256.

An object is named by vLLM's hash of its chunk's last block, under the namespace of
its layer (model, layout, KV-head shard, cache salt: config.py).  The digest of each
namespace (its *root*) is kept, so a key costs one SHA-256 of ``root + block hash``.
Callers that need a key twice keep it: nothing here remembers keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.keys import block_hash_root, keys_from_root

from .config import EngineInfo, block_hash_bytes, layer_namespace

#: namespace roots kept per worker (layers x KV-head shards x cache salts seen); beyond it they are recomputed
ROOTS_MAX = 1 << 14


class LayerKeys:
    """Keys of one engine's objects, for a KV-head shard (this rank's by default)."""

    def __init__(self, info: EngineInfo) -> None:
        self._info = info
        self._layers = info.layers
        self._shard = info.shard.shard
        self._roots: dict[tuple[int, int, str | None], bytes] = {}

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def keys(self, layer: int, hashes: Sequence[bytes], salt: str | None, shard: int | None = None) -> list[str]:
        """Keys of the chunks named by ``hashes`` (bytes) in ``layer``: one SHA-256 each."""
        sh = self._shard if shard is None else shard
        root = self._roots.get((sh, layer, salt))
        if root is None:
            root = block_hash_root(layer_namespace(self._info.namespaces[sh], self._info.key_name(layer), salt))
            if len(self._roots) >= ROOTS_MAX:
                self._roots.clear()
            self._roots[(sh, layer, salt)] = root
        return keys_from_root(root, hashes)

    def keys_of(self, layer: int, hashes: Sequence[object], salt: str | None, shard: int | None = None) -> list[str]:
        """:meth:`keys` of engine block hashes in any form vLLM gives them (see ``block_hash_bytes``)."""
        return self.keys(layer, [block_hash_bytes(h) for h in hashes], salt, shard)
