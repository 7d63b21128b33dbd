"""The SGLang backend's conformance checks, without a server: run in .venv-sglang by tests/test_sglang_backend.py.

Each check builds ``TierKVStorage`` through SGLang's own ``StorageBackendFactory`` (``dynamic`` backend) over
real SGLang host pools (MHA in each layout, MLA), the way its cache controller does, and drives the v1 and
generic paths.  ``python conformance.py OUT_DIR CHECK...`` prints one line ``TIERKV-RESULT {check: "ok" or
the error}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_util import _corrupt_files

RESULT_PREFIX = "TIERKV-RESULT "
LAYERS, HEADS, HEAD_DIM, TOKENS = 3, 2, 8, 256
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"


def dram_store(capacity: str = "64MiB") -> dict[str, Any]:
    return {"tiers": [{"medium": "dram", "capacity": capacity, "eviction": "lru"}]}


def mha_pool(layout: str = "layer_first", page: int = 16, dtype: torch.dtype = torch.bfloat16) -> Any:
    kv = MHATokenToKVPool(TOKENS, page, dtype, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    info = kv.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2, 0, page, layout, pin_memory=False, device_capacity_tokens=kv.size,
                                start_layer=0, end_layer=LAYERS, write_back_staging=kv.hicache_write_back_staging)


def mla_pool(layout: str = "layer_first", page: int = 16) -> Any:
    kv = MLATokenToKVPool(TOKENS, page, torch.bfloat16, 32, 16, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    info = kv.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2, 0, page, layout, pin_memory=False, device_capacity_tokens=kv.size,
                                start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)


def backend(pool: Any, store: dict[str, Any] | None = None, tp_rank: int = 0, tp_size: int = 1,
            mla: bool = False, **extra: Any) -> Any:
    """TierKVStorage built as SGLang builds a dynamic backend, with the pool registered."""
    config = {"backend_name": "tierkv", "module_path": "tierkv.adapters.sglang", "class_name": "TierKVStorage",
              "interface_v1": 1, "model_id": "tiny-test", "tierkv": store or dram_store(), **extra}
    sc = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                              attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                              is_page_first_layout=pool.layout == "page_first", model_name="tiny", extra_config=config)
    b = StorageBackendFactory.create_backend("dynamic", sc, pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def fill(pool: Any, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        page = pool.get_data_page(p * pool.page_size, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))


def page_bytes(pool: Any, p: int) -> bytes:
    return pool.get_data_page(p * pool.page_size, flat=True).view(torch.uint8).numpy().tobytes()


def indices(pool: Any, pages: list[int]) -> torch.Tensor:
    ps = pool.page_size
    return torch.tensor([p * ps + t for p in pages for t in range(ps)], dtype=torch.int64)


def hashes(n: int, tag: str = "") -> list[str]:
    """SGLang-like page hashes (hex SHA-256), distinct per ``tag``."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def zero(pool: Any, pages: list[int]) -> None:
    for p in pages:
        pool.get_data_page(p * pool.page_size, flat=False).zero_()


# -- checks ----------------------------------------------------------------------------------------------------
def roundtrip(layout: str) -> None:
    pool = mha_pool(layout)
    b = backend(pool)
    keys, src, dst = hashes(4, layout), [1, 2, 3, 4], [9, 10, 11, 12]
    fill(pool, src, 1)
    want = [page_bytes(pool, p) for p in src]
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, indices(pool, src)) == [True] * 4
    assert b.batch_exists(keys) == 4
    zero(pool, dst)
    assert b.batch_get_v1(keys, indices(pool, dst)) == [True] * 4
    assert [page_bytes(pool, p) for p in dst] == want, "v1 round trip not bit-exact"
    # the generic path reads (and writes) the same objects as SGLang's flat pages
    outs = [pool.get_dummy_flat_data_page() for _ in keys]
    got = b.batch_get(keys, outs)
    assert all(g is not None for g in got) and [o.view(torch.uint8).numpy().tobytes() for o in outs] == want
    assert b.exists(keys[0]) and not b.exists(hashes(1, "absent")[0])
    more = hashes(2, "generic" + layout)
    assert b.batch_set(more, [pool.get_data_page(p * pool.page_size) for p in src[:2]])
    zero(pool, dst[:2])
    assert b.batch_exists(more) == 2 and b.batch_get_v1(more, indices(pool, dst[:2])) == [True, True]
    assert [page_bytes(pool, p) for p in dst[:2]] == want[:2]
    st = b.tierkv_stats()
    assert st["faults"] == 0 and st["leases_taken"] >= 1, st
    b.close()


def hole() -> None:
    pool = mha_pool()
    b = backend(pool)
    keys, src = hashes(5, "hole"), [1, 2, 3, 4, 5]
    fill(pool, src, 2)
    stored = [0, 1, 3, 4]
    assert b.batch_set_v1([keys[i] for i in stored], indices(pool, [src[i] for i in stored])) == [True] * 4
    assert b.batch_exists(keys) == 2, "leading hits must stop at the hole"
    assert b.batch_exists(keys[3:]) == 2
    b.close()


def mla() -> None:
    store = dram_store()
    pool_w, pool_r = mla_pool(), mla_pool()
    writer = backend(pool_w, store, tp_rank=0, tp_size=2, mla=True)
    reader = backend(pool_r, store, tp_rank=1, tp_size=2, mla=True)
    assert writer.store is reader.store  # (one store per config in a process, as in a TP=1 test of both ranks)
    assert writer.namespaces == reader.namespaces, "MLA ranks must share one namespace"
    keys, src, dst = hashes(3, "mla"), [1, 2, 3], [5, 6, 7]
    fill(pool_r, src, 3)
    assert reader.batch_set_v1(keys, indices(pool_r, src)) == [True] * 3
    assert reader.store.stats()["total"].get("puts", 0) == 0 or reader.batch_exists(keys) == 0, \
        "the non-writer rank stored something"
    assert reader.batch_exists(keys) == 0 and reader.tierkv_stats()["writes_left_to_writer"] == 3
    fill(pool_w, src, 3)
    want = [page_bytes(pool_w, p) for p in src]
    assert writer.batch_set_v1(keys, indices(pool_w, src)) == [True] * 3
    assert reader.batch_exists(keys) == 3
    zero(pool_r, dst)
    assert reader.batch_get_v1(keys, indices(pool_r, dst)) == [True] * 3
    assert [page_bytes(pool_r, p) for p in dst] == want
    writer.close()
    reader.close()


def isolation() -> None:
    store = dram_store()
    keys = hashes(2, "iso")
    base = backend(mha_pool(), store, tp_rank=0, tp_size=2)
    fill(base.mem_pool_host, [1, 2], 4)
    assert base.batch_set_v1(keys, indices(base.mem_pool_host, [1, 2])) == [True, True]
    assert base.batch_exists(keys) == 2
    others = {
        "dtype": backend(mha_pool(dtype=torch.float16), store, tp_rank=0, tp_size=2),
        "layout": backend(mha_pool("page_first"), store, tp_rank=0, tp_size=2),
        "page size": backend(mha_pool(page=8), store, tp_rank=0, tp_size=2),
        "tp rank": backend(mha_pool(), store, tp_rank=1, tp_size=2),
        "tp size": backend(mha_pool(), store, tp_rank=0, tp_size=1),
        "model": backend(mha_pool(), store, tp_rank=0, tp_size=2, model_id="another-model"),
    }
    for what, b in others.items():
        assert b.namespaces["kv"] != base.namespaces["kv"], what
        assert b.batch_exists(keys) == 0, f"a config differing in {what} sees the pages"
        b.close()
    base.close()


def corrupt_ssd() -> None:
    path = os.path.join(OUT, "ssd-corrupt")
    store = {"tiers": [{"medium": "ssd", "path": path, "capacity": "64MiB"}]}
    pool = mha_pool()
    b = backend(pool, store)
    keys, src, dst = hashes(3, "bad"), [1, 2, 3], [5, 6, 7]
    fill(pool, src, 5)
    assert b.batch_set_v1(keys, indices(pool, src)) == [True] * 3
    b.close()  # (the last holder flushes and closes the store)
    assert _corrupt_files(path) >= 3
    pool2 = mha_pool()
    b = backend(pool2, store)
    zero(pool2, dst)
    n = b.batch_exists(keys)
    assert n == 3, f"the reopened index lists {n} of the 3 pages"
    got = b.batch_get_v1(keys, indices(pool2, dst))
    assert got == [False] * 3, f"a corrupted page was reported read: {got}"
    st = b.tierkv_stats()
    assert st["get_misses"] == n, st
    b.close()


def faults() -> None:
    pool = mha_pool()
    b = backend(pool)
    keys, src = hashes(2, "fault"), [1, 2]
    fill(pool, src, 6)
    assert b.batch_set_v1(keys, indices(pool, src)) == [True, True]

    def boom(*a: Any, **k: Any) -> Any:
        raise OSError("tier down")

    store = b.store
    real = (store.get, store.lookup, store.put)
    store.get = store.lookup = store.put = boom
    try:
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, indices(pool, [5, 6])) == [False, False]
        assert b.batch_set_v1(hashes(2, "f2"), indices(pool, src)) == [False, False]
        assert b.get(keys[0], pool.get_dummy_flat_data_page()) is None
        assert b.batch_set(keys, [pool.get_data_page(16)] * 2) is False
        assert b.exists(keys[0]) is False
        # a transfer whose host indices do not match its keys: a miss, not an exception
        store.get, store.lookup, store.put = real
        assert b.batch_get_v1(keys, indices(pool, [5])) == [False, False]
    finally:
        store.get, store.lookup, store.put = real
    assert b.tierkv_stats()["faults"] == 7, b.tierkv_stats()
    b.close()


def leases() -> None:
    pool = mha_pool()
    b = backend(pool, lease_timeout_s=30.0)
    keys = hashes(3, "lease")
    fill(pool, [1, 2, 3], 7)
    b.batch_set_v1(keys, indices(pool, [1, 2, 3]))
    assert b.batch_exists(keys) == 3
    assert len(b._held) == 3
    b.batch_get_v1(keys, indices(pool, [5, 6, 7]))
    assert not b._held, "a get releases the leases its exists took"
    b.close()


def mla_page_first() -> None:
    pool = mla_pool("page_first")
    b = backend(pool, mla=True)
    keys, src, dst = hashes(3, "mla-pf"), [1, 2, 3], [5, 6, 7]
    fill(pool, src, 8)
    want = [page_bytes(pool, p) for p in src]
    assert b.batch_set_v1(keys, indices(pool, src)) == [True] * 3
    zero(pool, dst)
    assert b.batch_exists(keys) == 3 and b.batch_get_v1(keys, indices(pool, dst)) == [True] * 3
    assert [page_bytes(pool, p) for p in dst] == want
    b.close()


def v2() -> None:
    """A hybrid model's extra pool (register_mem_host_pool_v2): its pages under its own name, SGLang's hit policies."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv, extra = mha_pool(), mha_pool("page_first")
    b = backend(kv)
    b.register_mem_host_pool_v2(extra, PoolName.MAMBA)
    assert b.namespaces["mamba"] != b.namespaces["kv"]
    keys, src, dst = hashes(4, "v2"), [1, 2, 3, 4], [9, 10]
    fill(kv, src, 9)
    fill(extra, src, 10)
    want = [page_bytes(extra, p) for p in src[:2]]
    assert b.batch_set_v1(keys, indices(kv, src)) == [True] * 4
    done = b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=indices(extra, src[:2]), keys=keys[:2])])
    assert done == {"mamba": [True, True]}, done
    r = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (2, {"kv": 4, "mamba": 2}), r
    r = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys[:1],
                                              hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert r.kv_hit_pages == 2 and r.restorable_prefix_pages == [1, 2], r
    zero(extra, dst)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=indices(extra, dst), keys=keys[:2])])
    assert got == {"mamba": [True, True]} and [page_bytes(extra, p) for p in dst] == want
    # a pool nobody registered: a miss, not an exception
    assert b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices(extra, dst), keys=keys[:2])]) \
        == {"swa": [False, False]}
    b.close()


CHECKS = {
    "roundtrip_layer_first": lambda: roundtrip("layer_first"),
    "roundtrip_page_first": lambda: roundtrip("page_first"),
    "roundtrip_page_first_direct": lambda: roundtrip("page_first_direct"),
    "roundtrip_page_head": lambda: roundtrip("page_head"),
    "hole": hole,
    "mla": mla,
    "mla_page_first": mla_page_first,
    "v2": v2,
    "isolation": isolation,
    "corrupt_ssd": corrupt_ssd,
    "faults": faults,
    "leases": leases,
}


def main(names: list[str]) -> None:
    out: dict[str, str] = {}
    for name in names or list(CHECKS):
        try:
            CHECKS[name]()
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc(limit=6)
    print(RESULT_PREFIX + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[2:])
