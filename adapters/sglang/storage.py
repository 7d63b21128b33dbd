"""``TierKVStorage``: a tierkv store as SGLang HiCache's storage tier (its "L3").

SGLang builds it through its dynamic backend factory (``--hicache-storage-backend dynamic``), one per
scheduler process (TP / PP rank), hands it the host KV pool (``register_mem_pool_host``; hybrid models' extra
pools through ``register_mem_host_pool_v2``) and calls it from the cache controller's prefetch and backup
threads.  Each page is one tierkv object whose key is SGLang's page hash under :func:`~.options.page_namespace`
(``tierkv.keys.keys_from_root``), so tierkv's dedup, checksums, leases, miss reasons, tenants, metrics and
traces hold for SGLang's pages as for vLLM's chunks.

Contract with SGLang's controller, kept on every path:

* a fault (a checksum that fails, a tier that is down, a deadline, any exception) is a miss: ``False`` /
  ``None`` / 0 hits, counted in :meth:`TierKVStorage.tierkv_stats` (``faults``) and logged, never an
  exception into the controller and never a page of wrong bytes reported as read;
* what ``batch_exists`` finds is leased in the store (``lease_timeout_s``) until the ``batch_get_v1`` that
  reads it, or the lease's deadline (a prefetch SGLang drops never reads);
* MLA: the latent is the same on every TP rank, so only SGLang's storage-writer rank stores it; every rank
  reads it (the others' ``batch_set_v1`` answers True and stores nothing, counted as ``writes_left_to_writer``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from tierkv.keys import block_hash_root, keys_from_root
from tierkv.shutdown import close_on_terminate
from tierkv.stores import STORES

from .options import EngineRanks, page_namespace, parse_options
from .pages import PoolPages

logger = logging.getLogger("sglang.tierkv")

_KV = "kv"
#: faults logged in full; later ones are only counted
_LOGGED_FAULTS = 20


class TierKVStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a tierkv ``TieredStore`` (see the module docstring and ``docs/sglang.md``)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.options = parse_options(getattr(storage_config, "extra_config", None))
        self.storage_config = storage_config
        self.ranks = EngineRanks.of(storage_config)
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        self._model = self.options.model_id
        self._model_name = getattr(storage_config, "model_name", None) or ""
        self._lease = STORES.acquire(self.options.store_config)
        self.store = self._lease.store
        # SGLang ends its scheduler processes with SIGTERM under Python's default disposition (no exit hook
        # runs): the store is closed first (write-behind copies made, the SSD checkpoint and the trace written)
        self.closes_on_terminate = close_on_terminate()
        self._pools: dict[str, PoolPages] = {}
        self._roots: dict[str, bytes] = {}
        self.namespaces: dict[str, str] = {}
        self._lock = threading.Lock()
        self._held: dict[str, Any] = {}  # tierkv key -> the lease batch_exists took for it
        self._stats = dict.fromkeys((
            "exists_calls", "exists_pages", "exists_hits", "get_pages", "get_hits", "get_misses", "set_pages",
            "set_stored", "set_failed", "writes_left_to_writer", "faults", "leases_taken"), 0)
        self._closed = False
        self.exporter: Any = None
        port = self.options.metrics_port
        if port is not None:
            try:
                from tierkv.metrics import serve

                g = self.ranks
                rank = g.pp_rank * g.tp_size + g.tp_rank
                self.exporter = serve(self.store, port + rank if port else 0, self.options.metrics_addr)
                logger.info("tierkv: store metrics at %s (status: %s)", self.exporter.url, self.exporter.status_url)
            except BaseException:
                self._lease.release()
                raise

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool(_KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._add_pool(str(getattr(host_pool_name, "value", host_pool_name)), host_pool)

    def on_host_pools_registered(self) -> None:
        logger.info("tierkv: %s", "; ".join(f"{name}: {ns}" for name, ns in self.namespaces.items()))

    def _model_part(self, pool: Any) -> str:
        if self._model is not None:
            return self._model
        name, tag = self._model_name, getattr(pool, "storage_format_tag", None)
        if tag and name.endswith("-" + str(tag)):  # (SGLang appends the pool's page format to the name)
            name = name[: -len(str(tag)) - 1]
        from tierkv.weights import weights_identity
        self._model = f"weights:{weights_identity(name)}" if name else "unnamed-model"
        return self._model

    def _add_pool(self, name: str, pool: Any) -> None:
        pages = PoolPages(pool)
        tag = getattr(pool, "storage_format_tag", None)
        ns = page_namespace(self._model_part(pool), self.ranks, name + (f"-{tag}" if tag else ""), pages.dtype,
                            pages.layout, pages.page_size, pages.layers, pages.page_shape, self.options.namespace)
        self._pools[name] = pages
        self.namespaces[name] = ns
        self._roots[name] = block_hash_root(ns)

    def keys(self, hashes: Sequence[str], pool: str = _KV) -> list[str]:
        """The tierkv keys of SGLang's page hashes in ``pool``."""
        return keys_from_root(self._roots[pool], list(hashes))

    # ------------------------------------------------------------------ faults
    def _fault(self, what: str, e: BaseException) -> None:
        with self._lock:
            self._stats["faults"] += 1
            n = self._stats["faults"]
        if n <= _LOGGED_FAULTS:
            logger.warning("tierkv: %s failed, answered as a miss: %s: %s", what, type(e).__name__, e)

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._stats[k] += v

    def _reads(self, what: str, n: int, fn: Callable[[], list[bool]]) -> list[bool]:
        """``fn()``, a read of ``n`` pages, counted; a fault is a miss of every page (counted, logged)."""
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - a fault is a miss for SGLang
            self._fault(what, e)
            res = [False] * n
        hits = sum(res)
        self._count(get_pages=n, get_hits=hits, get_misses=n - hits)
        return res

    def _writes(self, what: str, n: int, fn: Callable[[], list[bool]]) -> list[bool]:
        """``fn()``, a write of ``n`` pages, counted; a fault fails every page (counted, logged)."""
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - a failed write is a page not stored, never an exception
            self._fault(what, e)
            res = [False] * n
        ok = sum(res)
        self._count(set_pages=n, set_stored=ok, set_failed=n - ok)
        return res

    # ------------------------------------------------------------------ leases (exists -> get)
    def _hold(self, keys: list[str]) -> None:
        if not keys or self.options.lease_timeout_s <= 0:
            return
        lease = self.store.lease(keys, self.options.lease_timeout_s)
        if not lease.held:
            lease.release()
            return
        with self._lock:
            old = {id(x): x for x in (self._held.pop(k, None) for k in keys) if x is not None}
            for k in keys:
                self._held[k] = lease
            self._stats["leases_taken"] += 1
            if len(self._held) > 65536:  # (leases the store expired and nobody read: forget them)
                self._held = {k: x for k, x in self._held.items() if not x.released}
        for x in old.values():
            if x is not lease and not any(v is x for v in self._held.values()):
                x.release()

    def _let_go(self, keys: list[str]) -> None:
        with self._lock:
            if not self._held:
                return
            gone = {id(x): x for x in (self._held.pop(k, None) for k in keys) if x is not None}
            if gone:
                self._held = {k: x for k, x in self._held.items() if id(x) not in gone}
        for x in gone.values():
            x.release()

    # ------------------------------------------------------------------ v1: zero-copy, pages where they lie
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages are stored; those are leased until read."""
        try:
            tk = self.keys(keys)
            n = self.store.lookup(tk)
            self._count(exists_calls=1, exists_pages=len(tk), exists_hits=n)
            self._hold(tk[:n])
            return n
        except Exception as e:  # noqa: BLE001 - a fault is a miss for SGLang
            self._fault("batch_exists", e)
            return 0

    def _page_parts(self, pool: str, n: int, host_indices: torch.Tensor) -> list[list[torch.Tensor]]:
        pages = self._pools[pool]
        if int(host_indices.numel()) != n * pages.page_size:
            raise ValueError(f"{n} keys need {n * pages.page_size} host indices, got {int(host_indices.numel())}")
        starts = host_indices.tolist()[:: pages.page_size]
        return [pages.parts(int(s)) for s in starts]

    def _get_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        tk = self.keys(keys, pool)
        try:
            return self.store.get(tk, self._page_parts(pool, len(keys), host_indices))
        finally:
            self._let_go(tk)

    def _set_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        tk = self.keys(keys, pool)
        return self.store.put(tk, self._page_parts(pool, len(keys), host_indices), tenant=self.options.namespace)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read each page into the host pool at its host indices; False where it is not read."""
        return self._reads("batch_get_v1", len(keys), lambda: self._get_pages(_KV, keys, host_indices))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store each page from the host pool; True where stored (or already stored)."""
        if not self.is_writer:
            self._count(writes_left_to_writer=len(keys))
            return [True] * len(keys)
        return self._writes("batch_set_v1", len(keys), lambda: self._set_pages(_KV, keys, host_indices))

    # ------------------------------------------------------------------ the generic path (flat page copies)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Read each page into its flat target (``get_dummy_flat_data_page``); None where not read."""

        def read() -> list[bool]:
            if target_locations is None or len(target_locations) != len(keys):
                raise ValueError("the generic path needs one target tensor per key")
            tk = self.keys(keys)
            try:
                return self.store.get(tk, list(target_locations))
            finally:
                self._let_go(tk)

        res = self._reads("batch_get", len(keys), read)
        return [t if ok else None for t, ok in zip(target_locations or [None] * len(keys), res)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each flat page; True only when every one is stored."""
        if not self.is_writer:
            self._count(writes_left_to_writer=len(keys))
            return True

        def write() -> list[bool]:
            if values is None or len(values) != len(keys):
                raise ValueError("the generic path needs one value per key")
            return self.store.put(self.keys(keys), [v.contiguous() for v in values], tenant=self.options.namespace)

        return all(self._writes("batch_set", len(keys), write))

    def exists(self, key: str) -> bool:
        try:
            return self.store.lookup(self.keys([key])) == 1
        except Exception as e:  # noqa: BLE001
            self._fault("exists", e)
            return False

    # ------------------------------------------------------------------ v2: hybrid models' extra pools
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The leading KV pages stored, shortened to what every extra pool can restore (its hit policy)."""
        try:
            kv = self.batch_exists(keys, extra_info)
            hit_count: dict[str, int] = {_KV: kv} if kv else {}
            restorable = set(range(1, kv + 1))
            for t in pool_transfers or []:
                if not restorable:
                    break
                name = str(getattr(t.name, "value", t.name))
                present = self.store.contains(self.keys(keys[:kv], name)) if name in self._roots else [False] * kv
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = present.index(False) if False in present else kv
                    ok = set(range(1, boundary + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(t.keys) if t.keys else 1)
                    ok = {n for n in range(1, kv + 1) if all(present[max(0, n - trailing):n])}
                else:  # (a policy this backend does not serve restores nothing: a miss, never a wrong page)
                    ok = set()
                if ok:
                    hit_count[name] = max(ok)
                restorable &= ok
            order = sorted(restorable)
            return PoolTransferResult(order[-1] if order else 0, hit_count, order)
        except Exception as e:  # noqa: BLE001
            self._fault("batch_exists_v2", e)
            return PoolTransferResult(0, {}, [])

    def _batch_v2(self, transfers: list[PoolTransfer], op: str) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name = str(getattr(t.name, "value", t.name))
            keys = list(t.keys or [])
            try:
                if t.host_indices is None:
                    raise ValueError(f"pool {name!r}: a transfer without host indices")
                if op == "get":
                    out[name] = self._get_pages(name, keys, t.host_indices)
                elif not self.is_writer:
                    self._count(writes_left_to_writer=len(keys))
                    out[name] = [True] * len(keys)
                else:
                    out[name] = self._set_pages(name, keys, t.host_indices)
            except Exception as e:  # noqa: BLE001
                self._fault(f"batch_{op}_v2 ({name})", e)
                out[name] = [False] * len(keys)
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, "get")

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, "set")

    # ------------------------------------------------------------------ the rest
    def clear(self) -> bool:
        """Not done: the store may hold other engines' pages (``tierkv`` tools remove what an operator names)."""
        logger.warning("tierkv: clear() is not done by the backend: the store may be shared")
        return False

    def tierkv_stats(self) -> dict[str, Any]:
        """The backend's counts, and the store's ``stats()`` under ``"store"``."""
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
        out["store"] = self.store.stats()
        return out

    def close(self) -> None:
        """Release what was leased and give the store back (the last holder flushes and closes it)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            held, self._held = list({id(x): x for x in self._held.values()}.values()), {}
        for x in held:
            x.release()
        if self.exporter is not None:
            self.exporter.stop()
        self._lease.release()
