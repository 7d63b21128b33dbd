"""Replaying a trace through the real ``TieredStore`` over payload-free media.

``null_store(config)`` builds the configured chain with every medium swapped for
``NullTier`` (``tierkv.tiers.null``) at the same capacity and footprint rule,
keeping each tier's eviction and admission policies and the store's promotion
policy — custom ``"package.module:Class"`` policies included.  A shared pool
(``dram_pool``, ``remote_npu``), which evicts by itself in production, becomes a
managed null tier with LRU eviction unless the config names one.

``replay`` drives it as an engine would, one batch per request: ``lookup`` of
the request's block keys, ``get`` of the leading hits, ``put`` of the rest.

Reported:
* per tier: hits, bytes read and written, evictions, demotions, promotions;
* ``token_hit_rate``: prefix rule — a block's tokens count only when every
  block before it hit — over all prompt tokens; ``prefill_tokens_saved``;
* ``chunk_hit_rate``: blocks present anywhere in the store when requested
  (leading or not) over all blocks requested;
* with bandwidths per tier (bytes/s) and a prefill throughput (tokens/s): the
  time spent loading against the recompute time those loads replace; and the vLLM
  connector's decline rule (``adapters/vllm/decline.py``) applies: a hit's part on
  a tier that reads slower than the engine computes is not read (``declined``, by
  tier), vLLM would compute it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tierkv.config import load_config
from tierkv.errors import ConfigError
from tierkv.options import check_float
from tierkv.persist import PersistMode, default_persist, pop_persist
from tierkv.store import Level, TieredStore
from tierkv.tiers import medium_class
from tierkv.tiers.base import Tier
from tierkv.tiers.null import NullTier
from tierkv.units import parse_size

from .traces import Request

#: bytes of KV per token by default: 2 (K, V) x 32 layers x 8 KV heads x 128 x fp16 (a Llama-3-8B)
DEFAULT_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def footprint_rule(cls: type[Tier], options: dict[str, Any]):
    """``cls.footprint`` as a function of nbytes, evaluated without building the medium.

    The footprint methods of media read only a few configured attributes (e.g.
    the SSD's ``direct_io``); a bare instance given the config's options as
    attributes answers like a built one.  None when the rule is the identity or
    cannot be evaluated this way (then bytes count as themselves).
    """
    if cls.footprint is Tier.footprint:
        return None
    probe = object.__new__(cls)
    for k, v in options.items():
        try:
            setattr(probe, k, v)
        except (AttributeError, TypeError):
            pass
    for k, default in (("direct_io", False),):
        if not hasattr(probe, k):
            setattr(probe, k, default)
    try:
        int(cls.footprint(probe, 4096))
    except Exception:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
        return None
    return lambda n: cls.footprint(probe, n)


def null_store(config: Any, capacities: Optional[dict[str, int]] = None,
               evictions: Optional[dict[str, Any]] = None) -> TieredStore:
    """The configured chain over null media; ``capacities`` / ``evictions`` override tiers by name."""
    cfg = load_config(config)
    capacities = dict(capacities or {})
    evictions = dict(evictions or {})
    levels: list[Level] = []
    names: list[str] = []
    for pos, raw in enumerate(cfg["tiers"]):
        if not isinstance(raw, dict):
            raise ConfigError(f"tiers[{pos}] must be a mapping, got {raw!r}")
        opts = copy.deepcopy(raw)
        medium = opts.pop("medium", None)
        if medium is None:
            raise ConfigError(f"tiers[{pos}] lacks 'medium'")
        try:
            cls = medium_class(medium)
        except ConfigError:
            raise
        name = opts.pop("name", None) or (cls.medium or str(medium))
        names.append(name)
        eviction = evictions.pop(name, opts.pop("eviction", None))
        admission = opts.pop("admission", None)
        persist = pop_persist(opts, f"tier {name!r}") or default_persist(cls)
        if persist == "write_behind":
            # the same placement as the background copy, made synchronously: a replay is deterministic
            persist = PersistMode.WRITE_THROUGH
        raw_cap = capacities.pop(name, opts.pop("capacity", None))
        if raw_cap is None:
            raise ConfigError(f"tier {name!r} has no 'capacity' in the config: give the simulator one "
                              f"(--capacity {name}=SIZE)")
        cap = parse_size(raw_cap, f"tier {name!r} capacity")
        tier = NullTier(name, cap, footprint=footprint_rule(cls, opts), locality=getattr(cls, "locality", "host"))
        levels.append(Level(tier, eviction=eviction, admission=admission, persist=persist))
    left = sorted(set(capacities) | set(evictions))
    if left:
        raise ConfigError(f"no tier named {left} in the config; tiers: {names}")
    return TieredStore(levels, promotion=cfg.get("promotion"), io_workers=1)


@dataclass
class SimResult:  # (a dataclass of figures, alike in shape only to ``tierkv.stats``' counters)
    requests: int = 0
    blocks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    leading_hits: int = 0
    present_blocks: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    block_bytes: int = 0
    load_s: Optional[float] = None
    recompute_s: Optional[float] = None
    #: hits not read because their tier reads slower than the prefill computes (bandwidths and a prefill rate
    #: given): hits and tokens by the tier that cut them
    declined_hits: dict[str, int] = field(default_factory=dict)
    declined_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def chunk_hit_rate(self) -> float:
        return self.present_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "blocks": self.blocks, "prompt_tokens": self.prompt_tokens,
                "prefill_tokens_saved": self.hit_tokens, "token_hit_rate": self.token_hit_rate,
                "chunk_hit_rate": self.chunk_hit_rate, "leading_hits": self.leading_hits,
                "block_bytes": self.block_bytes, "load_s": self.load_s, "recompute_s": self.recompute_s,
                "declined_hits": self.declined_hits, "declined_tokens": self.declined_tokens,
                "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                "requests_per_s": self.requests / self.wall_s if self.wall_s else None,
                "tiers": self.tiers}


TIER_FIELDS = ("capacity_bytes", "used_bytes", "entries", "hits", "misses", "bytes_read", "bytes_written", "evictions",
               "demotions", "promotions", "rejected", "too_large", "eviction")


def replay(requests: Iterable[Request], store: TieredStore, bytes_per_token: Optional[int] = DEFAULT_BYTES_PER_TOKEN,
           bandwidths: Optional[dict[str, float]] = None, prefill_tokens_per_s: Optional[float] = None,
           progress=None, decline: bool = True, decline_margin_s: float = 0.05) -> SimResult:
    """Drive ``store`` with ``requests`` (lookup, get of the leading hits, put of the rest; one batch each).

    Every block is ``bytes_per_token * block_tokens`` bytes; with ``bytes_per_token=None``, the request's
    own ``block_bytes`` (a trace that carries sizes), else ``DEFAULT_BYTES_PER_TOKEN`` per token.  ``bandwidths`` maps a
    tier name to its read bandwidth in bytes/s; with ``prefill_tokens_per_s`` the
    result carries ``load_s`` (time to read every hit) and ``recompute_s`` (time to
    prefill the tokens those hits saved).  With both (and ``decline``), the vLLM connector's rule applies: the
    hit is cut at the first block of a tier whose read of the hit's tokens on it takes longer than their prefill,
    by more than ``decline_margin_s`` (the connector's ``decline_margin_ms``) (``declined_hits``,
    ``declined_tokens``); a tier without a bandwidth is never declined.  ``progress(n)`` is
    called every 1000 requests and once at the end for the rest, so the counts add up to the requests replayed.
    """
    res = SimResult()
    if decline_margin_s < 0:
        raise ValueError(f"decline margin must be 0 seconds or more, got {decline_margin_s}")
    rule = (bandwidths, float(prefill_tokens_per_s), float(decline_margin_s)) \
        if decline and bandwidths and prefill_tokens_per_s else None
    bufs: dict[int, torch.Tensor] = {}  # one never-touched buffer per block size: null media keep no bytes
    t0, c0 = time.perf_counter(), time.process_time()
    lookup, get, put, drain = store.lookup, store.get, store.put, store.drain_write_behind
    dedup0 = store.stats()["total"]["chunks_deduped"]
    for r in requests:
        nb = len(r.hash_ids)
        res.requests += 1
        res.prompt_tokens += r.input_length
        if progress is not None and res.requests % 1000 == 0:
            progress(1000)
        if not nb:
            continue
        size = bytes_per_token * r.block_tokens if bytes_per_token else \
            (r.block_bytes or DEFAULT_BYTES_PER_TOKEN * r.block_tokens)
        buf = bufs.get(size)
        if buf is None:
            buf = bufs[size] = torch.empty(size, dtype=torch.uint8)
        keys = [f"b{h}" for h in r.hash_ids]
        res.blocks += nb
        n = lookup(keys)
        lead = 0
        if n and rule is not None:
            n = _claimed(res, store.locate(keys[:n]), r.block_tokens, size, *rule)
        if n:
            for ok in get(keys[:n], [buf] * n):
                if not ok:
                    break
                lead += 1
            drain()  # (promotions run on the store's background queue: landed before the next request)
        res.leading_hits += lead
        res.hit_tokens += min(lead * r.block_tokens, r.input_length)
        if lead < nb:
            put(keys[lead:], [buf] * (nb - lead))
    if progress is not None and res.requests % 1000:
        progress(res.requests % 1000)
    res.wall_s = time.perf_counter() - t0
    res.cpu_s = time.process_time() - c0
    st = store.stats()
    res.present_blocks = res.leading_hits + st["total"]["chunks_deduped"] - dedup0
    res.block_bytes = max(bufs, default=0)  # (the largest, where a trace mixes block sizes)
    for name, t in st["tiers"].items():
        res.tiers[name] = {k: t.get(k) for k in TIER_FIELDS}
    if bandwidths is not None:
        missing = [n for n in res.tiers if res.tiers[n]["hits"] and not bandwidths.get(n)]
        if not missing:
            res.load_s = sum(t["bytes_read"] / bandwidths[n] for n, t in res.tiers.items() if t["bytes_read"])
        for name, t in res.tiers.items():
            bw = bandwidths.get(name)
            t["read_bandwidth"] = bw
            t["load_s"] = t["bytes_read"] / bw if bw else None
    if prefill_tokens_per_s:
        check_float(prefill_tokens_per_s, "prefill tokens per second", min_value=0, min_exclusive=True)
        res.recompute_s = res.hit_tokens / prefill_tokens_per_s
    return res


def _claimed(res: SimResult, where: list[Optional[str]], block_tokens: int, block_bytes: int,
             bandwidths: dict[str, float], prefill_tokens_per_s: float, margin_s: float) -> int:
    """The blocks of a hit the connector's rule claims (``where``: each block's tier); its declines counted.
    A tier is slow where reading its tokens of the hit takes longer than computing them, by more than
    ``margin_s`` (fixed rates: no latency, no probe)."""
    from tierkv.adapters.vllm.decline import cut  # (pure: no vLLM)

    def slow(tier: str, tokens: int) -> bool:
        bw = bandwidths.get(tier)
        if not bw:
            return False
        return tokens * block_bytes / block_tokens / bw > tokens / prefill_tokens_per_s + margin_s

    v = cut(where, block_tokens, slow)
    if v.declined is not None:
        res.declined_hits[v.declined] = res.declined_hits.get(v.declined, 0) + 1
        res.declined_tokens[v.declined] = res.declined_tokens.get(v.declined, 0) + v.declined_tokens
    return v.blocks


def tune_allocator() -> bool:
    """For a process that only simulates: let glibc serve the store's 64 MiB staging buffers from its heap.

    Every demotion stages the victim in a fresh ``torch.empty(nbytes)``; above glibc's
    mmap threshold (32 MiB at most) each one is an mmap and a munmap, which was half
    the CPU time of a three-tier replay here.  Null media never touch those buffers,
    so serving them from the heap costs no memory.  Process-wide: ``tierkv simulate``
    calls it, a library user decides for their own process.  False where it is not glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 30))


def simulate(requests: Iterable[Request], config: Any, **kw: Any) -> SimResult:
    """``replay`` on a fresh ``null_store(config)``; ``capacities`` / ``evictions`` pass to ``null_store``."""
    store = null_store(config, capacities=kw.pop("capacities", None), evictions=kw.pop("evictions", None))
    try:
        return replay(requests, store, **kw)
    finally:
        store.close()
