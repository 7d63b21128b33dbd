"""Store keys of the connector's objects: one key per (chunk, layer, stored KV-head shard), each one SHA-256.

An object is named by vLLM's hash of its chunk's last block, under the namespace of
its layer (model, layout, stored KV-head shard, cache salt: config.py).  The parts
index *slices* (``EngineInfo.slice_names``): a layer, or, when a rank holds several
stored KV-head shards of a layer (``kv_head_shards``), one of them.  The digest of
each namespace (its *root*) is kept, so a key costs one SHA-256 of ``root + block
hash``.  Callers that need a key twice keep it: nothing here remembers keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.keys import block_hash_root, keys_from_root

from .config import EngineInfo, block_hash_bytes, layer_namespace

#: namespace roots kept per worker (layers x KV-head shards x cache salts seen); beyond it they are recomputed
ROOTS_MAX = 1 << 14


class LayerKeys:
    """Keys of one rank's objects, by slice (a layer and a stored KV-head shard, see ``EngineInfo``)."""

    def __init__(self, info: EngineInfo) -> None:
        self._info = info
        self._num = len(info.slice_names)
        self._roots: dict[tuple[int, str | None], bytes] = {}

    @property
    def num_slices(self) -> int:
        """The slices (one per layer unless a rank holds several stored KV-head shards of a layer)."""
        return self._num

    def keys(self, layer: int, hashes: Sequence[bytes], salt: str | None) -> list[str]:
        """Keys of the chunks named by ``hashes`` (bytes) in slice ``layer``: one SHA-256 each."""
        root = self._roots.get((layer, salt))
        if root is None:
            info = self._info
            ns = info.namespaces[info.slice_shard(layer)]
            root = block_hash_root(layer_namespace(ns, info.key_name(info.slice_layer(layer)), salt))
            if len(self._roots) >= ROOTS_MAX:
                self._roots.clear()
            self._roots[(layer, salt)] = root
        return keys_from_root(root, hashes)

    def keys_of(self, layer: int, hashes: Sequence[object], salt: str | None) -> list[str]:
        """:meth:`keys` of engine block hashes in any form vLLM gives them (see ``block_hash_bytes``)."""
        return self.keys(layer, [block_hash_bytes(h) for h in hashes], salt)
