"""MemFabric memcache (``memcache_hybrid.DistributedObjectStore``) as a remote backend (``dram_pool``).

Ascend only.  Written against memcache's documented Python API:

    store = DistributedObjectStore()
    store.init(local_rank, init_bm=True)           # config file from MMC_LOCAL_CONFIG_PATH
    store.register_buffer(ptr, size)
    store.batch_is_exist(keys)                      # 1 present, 0 absent, < 0 error, per key
    store.batch_put_from_layers(keys, ptrs_2d, sizes_2d, direction)
    store.batch_get_into_layers(keys, ptrs_2d, sizes_2d, direction)

``ptrs_2d[i]`` / ``sizes_2d[i]`` are the parts of object ``i`` (one per layer),
which is exactly tierkv's multi-part layout.  Copy directions follow memcache's
``smem_bm_copy_type``: device memory uses 0 (local→global) and 1 (global→local),
host memory 3 (host→global) and 2 (global→host).  Keys must be shorter than 256
bytes; errors are negative codes (-3000…-3105).

This backend is exercised against a fake of that API in the tests; it has not
been run on Ascend hardware.  The module ``memcache_hybrid`` is imported only
when ``"backend": "memcache"`` is selected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.errors import ConfigError
from tierkv.options import pop_int, pop_size, pop_str

from .client import Backend, BackendSpec, Outcome
from .options import what

LOCAL_TO_GLOBAL, GLOBAL_TO_LOCAL, GLOBAL_TO_HOST, HOST_TO_GLOBAL = 0, 1, 2, 3
MAX_KEY_BYTES = 255


@dataclass
class MemcacheSettings:
    local_rank: int
    config_path: str | None
    capacity_default: int | None


def import_memcache() -> Any:
    try:
        import memcache_hybrid
    except ImportError as e:
        raise ConfigError(
            "backend 'memcache' needs MemFabric's memcache_hybrid module (Ascend only; installed with "
            f"MemFabric / memcache); it is not importable here ({e})"
        ) from e
    return memcache_hybrid


def pop_memcache_settings(tier: str, options: dict[str, Any]) -> MemcacheSettings:
    w = what(tier)
    for k in ("master", "metadata_server", "protocol", "mode"):
        if k in options:
            raise ConfigError(f"{w}: {k!r} is a Mooncake option; the memcache backend is configured "
                              "by its config file ('config_path' or MMC_LOCAL_CONFIG_PATH)")
    rank = pop_int(options, "local_rank", 0, w, min_value=0)
    path = pop_str(options, "config_path", None, w)
    seg = pop_size(options, "segment", None, w)
    return MemcacheSettings(local_rank=rank, config_path=path, capacity_default=seg)


def _per_key(result: Any, n: int) -> list[int]:
    """memcache batch calls answer one code per key, or one code for the batch."""
    if isinstance(result, (list, tuple)):
        out = [int(r) for r in result]
        if len(out) != n:
            raise RuntimeError(f"memcache answered {len(out)} results for {n} keys")
        return out
    return [int(result)] * n


def outcome_of(code: int) -> Outcome:
    """memcache's codes say only success or failure; existing keys are handled in ``put``."""
    return Outcome.OK if code >= 0 else Outcome.ERROR


class MemcacheClient:
    """One initialised ``DistributedObjectStore``.  Methods block; the tier runs them off the caller's path."""

    outcome = staticmethod(outcome_of)
    max_key_len = MAX_KEY_BYTES

    def __init__(self, settings: MemcacheSettings) -> None:
        mod = import_memcache()
        if settings.config_path and not os.environ.get("MMC_LOCAL_CONFIG_PATH"):
            os.environ["MMC_LOCAL_CONFIG_PATH"] = settings.config_path
        self._store = mod.DistributedObjectStore()
        rc = self._store.init(settings.local_rank, init_bm=True)
        if rc not in (0, None):
            raise ConnectionError(f"memcache init(local_rank={settings.local_rank}) failed with code {rc}")
        self._sentinel_buf = torch.full((8,), 0x5A, dtype=torch.uint8)
        if self.register(self._sentinel_buf.data_ptr(), 8) != 0:
            raise ConnectionError("memcache register_buffer failed for the sentinel buffer")

    def accepts_device(self, device_type: str) -> bool:
        return device_type in ("cpu", "npu")

    def register(self, ptr: int, nbytes: int) -> int:
        rc = self._store.register_buffer(ptr, nbytes)
        return 0 if rc is None else int(rc)

    def unregister(self, ptr: int) -> int:
        fn = getattr(self._store, "unregister_buffer", None)
        return 0 if fn is None else int(fn(ptr) or 0)

    @staticmethod
    def _groups(n: int, devices: Sequence[str] | None) -> dict[bool, list[int]]:
        """Object indices by whether they live on the device (one copy direction per memcache call)."""
        groups: dict[bool, list[int]] = {}
        for i in range(n):
            groups.setdefault(devices is not None and devices[i] == "npu", []).append(i)
        return groups

    def exists(self, keys: Sequence[str]) -> list[int]:
        return _per_key(self._store.batch_is_exist(list(keys)), len(keys))

    def _layers(self, call: Any, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                sizes: Sequence[Sequence[int]], devices: Sequence[str] | None, to_pool: bool) -> list[int]:
        out = [0] * len(keys)
        for on_device, idx in self._groups(len(keys), devices).items():
            if to_pool:
                direction = LOCAL_TO_GLOBAL if on_device else HOST_TO_GLOBAL
            else:
                direction = GLOBAL_TO_LOCAL if on_device else GLOBAL_TO_HOST
            codes = _per_key(call([keys[i] for i in idx], [list(ptrs[i]) for i in idx],
                                  [list(sizes[i]) for i in idx], direction), len(idx))
            for i, c in zip(idx, codes):
                out[i] = c
        return out

    def put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            devices: Sequence[str] | None = None) -> list[int]:
        keys = list(keys)
        # dedup first: memcache reports an existing key as an error, tierkv counts it as stored
        present = self.exists(keys)
        out = [0 if p == 1 else -1 for p in present]
        idx = [i for i, p in enumerate(present) if p != 1]
        if idx:
            codes = self._layers(self._store.batch_put_from_layers, [keys[i] for i in idx], [ptrs[i] for i in idx],
                                 [sizes[i] for i in idx], [devices[i] for i in idx] if devices else None, True)
            failed = [i for i, c in zip(idx, codes) if c != 0]
            for i, c in zip(idx, codes):
                out[i] = c
            if failed:  # a concurrent writer may have stored the same content first
                again = self.exists([keys[i] for i in failed])
                for i, p in zip(failed, again):
                    if p == 1:
                        out[i] = 0
        return out

    def get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            devices: Sequence[str] | None = None) -> list[int]:
        codes = self._layers(self._store.batch_get_into_layers, list(keys), ptrs, sizes, devices, False)
        # memcache answers 0 for a complete copy; tierkv compares byte counts
        return [sum(sizes[i]) if c == 0 else (c if c < 0 else -1) for i, c in enumerate(codes)]

    def remove(self, keys: Sequence[str]) -> list[int]:
        fn = getattr(self._store, "batch_remove", None)
        if fn is not None:
            return _per_key(fn(list(keys)), len(keys))
        return [int(self._store.remove(k) or 0) for k in keys]

    def put_sentinel(self, key: str) -> int:
        return self.put([key], [[self._sentinel_buf.data_ptr()]], [[8]], ["cpu"])[0]

    def close(self) -> None:
        fn = getattr(self._store, "close", None) or getattr(self._store, "tear_down", None)
        if fn is not None:
            fn()


class MemcacheBackend(Backend):
    """``"backend": "memcache"``: MemFabric's memcache on Ascend (only a fake of it runs here)."""

    media = frozenset({"dram_pool"})

    @classmethod
    def configure(cls, tier: str, medium: str, options: dict[str, Any], *, device: str = "cpu") -> BackendSpec:
        settings = pop_memcache_settings(tier, options)
        import_memcache()
        return BackendSpec(open_client=lambda: MemcacheClient(settings), description="memfabric memcache",
                           default_capacity=settings.capacity_default, max_key_len=MAX_KEY_BYTES)
