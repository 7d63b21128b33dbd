"""``TierIO``: the one choke point between the engine and the media.

Every read, write, presence question and delete the engine puts to a tier goes
through one of its typed methods; a medium's exception (or a wrong number of
answers) becomes a logged miss here and nowhere else, and only
``StoreClosedError`` passes through.  A managed level's batch that fails is
asked again key by key, so one chunk's fault never costs the others.

A located level's reads and writes go by the codes of its index (``write_at`` /
``read_at``): the caller holds those entries (pinned, or reserved by it), and may
hand over the ``codes`` it already read under the lock, and ``ptrs``: the host
addresses of buffers it checked are one flat part of exactly each chunk's size
(``to_parts_ptrs``, and sizes matched against the index).

Checksums (``tierkv.checksum``): every write is handed each chunk's sum, computed once
where the put brought the bytes in and copied from level to level since, never
recomputed from bytes nobody verified.  A level that keeps sums (``Level.keeps_sums``)
gets them in its column; a pool that carries them inside the object
(``Tier.sum_inside``) gets each object with a trailer after the chunk's bytes.  A read
is checked here: from a pool, always (the trailer against the bytes); from a level that
keeps sums, when ``Level.checks_reads``; a medium that verifies its own records
(``Tier.verifies_reads``) is trusted, and a copy out of it is summed from the bytes it
verified.  A copy that fails its check, or that the medium answers ``CORRUPT``, is
counted ``corrupt`` for the level, recorded as a departure (``MissReason.CORRUPT``),
logged (rate-limited, naming the tier and the key) and answered False: a miss, never
bytes.  The caller drops it from a managed level (the
reader does for every failed read); a pool's copy is deleted here.
"""

from __future__ import annotations

import enum
import itertools
import logging
from typing import Any, Optional

from tierkv.buffers import Parts, on_two_threads
from tierkv.checksum import CorruptLog, ReadSums, TrailerArena, chunk_sum, chunk_sums, read_trailers
from tierkv.engine.chain import Chain
from tierkv.engine.departures import Departures
from tierkv.engine.level import Level
from tierkv.errors import StoreClosedError
from tierkv.outcome import MissReason
from tierkv.tiers.base import CORRUPT

log = logging.getLogger("tierkv")


class Op(enum.Enum):
    """What the engine asks of a tier."""

    READ = "read"
    WRITE = "write"
    CONTAINS = "contains"
    DELETE = "delete"


class TierIO:
    """The engine's typed calls into media (see the module docstring)."""

    def __init__(self, chain: Chain, departures: Departures) -> None:
        self._lock = chain.lock
        self._departures = departures  # (the store's miss memory: a corrupt copy dropped is remembered)
        self._corrupt_log = CorruptLog()
        self._trailers = TrailerArena()

    # ------------------------------------------------------------------ bytes
    def read(self, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]] = None,
             codes: Optional[list[int]] = None, sums_out: Optional[list[Optional[int]]] = None) -> list[bool]:
        """Read each chunk into its parts; one bool each (a medium fault or a failed check: False, never
        raised).  ``sums_out``, when given (a copy), receives each chunk's sum (None where none is known)."""
        n = len(keys)
        got: Optional[list[Optional[int]]] = None  # each chunk's sum, hashed right after its copy
        if lvl.checks_reads and lvl.located:
            if lvl.tier.sums_copies and ptrs is not None:  # the medium sums each chunk as it copies it
                asked = ReadSums([sum([p.numel() for p in ps]) for ps in parts])
                oks = self._bytes(Op.READ, lvl, keys, parts, ptrs, codes, asked)
                got = asked.sums
            elif n > 1:
                cuts = _groups(parts, _CHECK_GROUP)
                if len(cuts) > 2:
                    oks, got = self._read_groups(lvl, keys, parts, ptrs, codes, cuts)
        if got is None:
            oks = self._bytes(Op.READ, lvl, keys, parts, ptrs, codes)
        if CORRUPT in oks:
            oks = self._corrupt(lvl, keys, oks, [i for i, ok in enumerate(oks) if ok is CORRUPT])
        if lvl.checks_reads or sums_out is not None:
            self._check_level(lvl, keys, parts, oks, sums_out, got)
        return oks

    def _read_groups(self, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]],
                     codes: Optional[list[int]], cuts: list[int]) -> tuple[list, list[Optional[int]]]:
        """A checked read of a slab in groups of about ``_CHECK_GROUP`` bytes, each group hashed right after its
        copy while its bytes are still in cache; the groups shared by two threads (both the copy and the hash
        run outside the interpreter lock).  Returns each chunk's answer and the sum of each chunk read."""
        spans = list(itertools.pairwise(cuts))
        oks: list = [False] * len(keys)
        got: list[Optional[int]] = [None] * len(keys)

        def one(g: int) -> None:
            a, b = spans[g]
            res = self._bytes(Op.READ, lvl, keys[a:b], parts[a:b], None if ptrs is None else ptrs[a:b],
                              None if codes is None else codes[a:b])
            oks[a:b] = res
            read = [a + k for k, ok in enumerate(res) if ok is True]
            for i, s in zip(read, chunk_sums([parts[i] for i in read])):
                got[i] = s

        on_two_threads(one, range(len(spans)), [_nbytes(parts[a:b]) for a, b in spans])
        return oks, got

    def write(self, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]] = None,
              sums: Optional[list[Optional[int]]] = None, source: Optional[Level] = None) -> list[bool]:
        """Write each chunk from its parts (reserved by the caller in a managed level); one bool each.

        ``sums``: each chunk's checksum as it travels (a put's, or the copy's source's); one that is None
        (a chunk whose source kept none) is computed from the bytes here.  ``source``: the level a copy was
        read from; when its read was not checked and ``lvl`` sums the bytes itself (``verifies_reads``), the
        bytes are checked against the sums first (a corrupt copy is counted at the source, never stored)."""
        inside = lvl.tier.sum_inside
        if (inside or lvl.keeps_sums) and (sums is None or None in sums):
            sums = [chunk_sum(p) if sums is None or sums[i] is None else sums[i]  # type: ignore[misc]
                    for i, p in enumerate(parts)]
        if (sums is not None and source is not None and lvl.tier.verifies_reads and source.keeps_sums
                and not source.checks_reads):
            oks = self.check(source, keys, parts, sums)
            if False in oks:
                go = [i for i, ok in enumerate(oks) if ok]
                wrote = self.write(lvl, [keys[i] for i in go], [parts[i] for i in go], None,
                                   [sums[i] for i in go]) if go else []
                for i, ok in zip(go, wrote):
                    oks[i] = ok
                return oks
        if inside:
            before = _abandoned(lvl.tier)
            tr = self._trailers.packed(sums, _device_of(parts))  # type: ignore[arg-type]
            parts = [[*p, t] for p, t in zip(parts, tr)]
            ptrs = None
        oks = self._bytes(Op.WRITE, lvl, keys, parts, ptrs, None)
        if inside and _abandoned(lvl.tier) != before:
            self._trailers.drop()  # (an abandoned call may still read them)
        if lvl.keeps_sums and sums is not None:
            with self._lock:
                if False in oks:
                    lvl.sums.update([(k, s) for k, s, ok in zip(keys, sums, oks) if ok])  # type: ignore[misc]
                else:
                    lvl.sums.update(zip(keys, sums))  # type: ignore[arg-type]
        return oks

    def check(self, lvl: Level, keys: list[str], parts: list[Parts], sums: list[Optional[int]]) -> list[bool]:
        """Check bytes held by ``lvl`` (views, or a copy) against ``sums``; one bool each (a failure is
        counted corrupt for ``lvl`` and logged; the caller drops it)."""
        oks = [True] * len(keys)
        bad = [i for i, s in enumerate(sums) if s is not None and chunk_sum(parts[i]) != s]
        if bad:
            self._corrupt(lvl, keys, oks, bad, in_place=True)
        return oks

    def _check_level(self, lvl: Level, keys: list[str], parts: list[Parts], oks: list[bool],
                     sums_out: Optional[list[Optional[int]]], got: Optional[list[Optional[int]]] = None) -> None:
        """Check a managed level's reads against its sums (``checks_reads``; ``got``: the sums of the bytes
        read, where already hashed); fill ``sums_out``."""
        if lvl.keeps_sums:
            get = lvl.sums.get
            have = [get(k) for k in keys]
            bad: list[int] = []
            if lvl.checks_reads:
                for i, ok in enumerate(oks):
                    s = have[i]
                    if ok and s is not None and (chunk_sum(parts[i]) if got is None or got[i] is None
                                                 else got[i]) != s:
                        bad.append(i)
                if bad:
                    self._corrupt(lvl, keys, oks, bad, in_place=True)
            if sums_out is not None:
                sums_out[:] = have
        elif sums_out is not None:
            # a medium that verified its own records (or keeps no bytes): the bytes it handed over are checked
            sums_out[:] = [chunk_sum(p) if ok and lvl.tier.verifies_reads else None for p, ok in zip(parts, oks)]

    def _corrupt(self, lvl: Level, keys: list[str], oks: list, at: list[int], in_place: bool = False) -> list[bool]:
        """Count, log and answer False for the copies at ``at`` (a pool's are deleted from it)."""
        out = oks if in_place else [bool(ok) for ok in oks]
        for i in at:
            out[i] = False
        names = [keys[i] for i in at]
        with self._lock:
            lvl.counters.corrupt += len(at)
        self._departures.record(names, MissReason.CORRUPT, lvl.name)  # (a later miss of them says why)
        self._corrupt_log.found(lvl.name, names)
        if not lvl.managed:
            self.delete(lvl, names)
        return out

    def _bytes(self, op: Op, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]],
               codes: Optional[list[int]], sums: Optional[ReadSums] = None) -> list[bool]:
        try:
            return self._batch(op, lvl, keys, parts, ptrs, codes, sums)
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s %s failed: %s", lvl.name, op.value, str(e)[:300])
            if sums is not None:  # (whatever the failed call summed is not trusted: the bytes are summed again)
                sums.sums[:] = [None] * len(keys)
            if len(keys) > 1 and lvl.managed and lvl.tier.available:
                # one chunk's fault never costs the others: a local medium is asked again key by key
                return self._one_by_one(op, lvl, keys, parts, ptrs, codes)
            return [False] * len(keys)

    def _batch(self, op: Op, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]],
               codes: Optional[list[int]], sums: Optional[ReadSums] = None) -> list[bool]:
        tier = lvl.tier
        if lvl.located:
            if codes is None:
                with self._lock:
                    codes = lvl.codes(keys)
            if op is Op.WRITE:
                tier.write_at(codes, parts, ptrs)
                return [True] * len(keys)
            res = tier.read_at(codes, parts, ptrs, sums) if sums is not None else tier.read_at(codes, parts, ptrs)
        elif op is Op.WRITE:
            res = tier.write(keys, parts)
        else:
            res = tier.read(keys, parts)
        return _checked(res, len(keys))

    def _one_by_one(self, op: Op, lvl: Level, keys: list[str], parts: list[Parts],
                    ptrs: Optional[list[int]], codes: Optional[list[int]]) -> list[bool]:
        """Each key alone, after the batch failed: a key whose own call fails is a miss."""
        out: list[bool] = []
        failed = 0
        for i, key in enumerate(keys):
            try:
                ok = self._batch(op, lvl, [key], [parts[i]], None if ptrs is None else [ptrs[i]],
                                 None if codes is None else [codes[i]])[0]
            except StoreClosedError:
                raise
            except Exception:  # noqa: BLE001 - the choke point: a medium fault is a miss
                failed += 1
                ok = False
            out.append(ok if ok is CORRUPT else bool(ok))
        if failed:
            log.warning("tierkv: tier %s %s: %d of %d chunks failed alone; the rest went through",
                        lvl.name, op.value, failed, len(keys))
        return out

    # ------------------------------------------------------------------ shared pools
    def contains(self, lvl: Level, keys: list[str]) -> Optional[list[bool]]:
        """Presence of each key in a tier; None when the medium failed."""
        try:
            return _checked(lvl.tier.contains(keys), len(keys))
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s contains failed: %s", lvl.name, str(e)[:300])
            return None

    def read_unmanaged(self, lvl: Level, keys: list[str], parts: list[Parts],
                       sums_out: Optional[list[Optional[int]]] = None) -> Optional[list[bool]]:
        """A shared pool's read, each object's trailer checked (``sum_inside``); None when the medium failed
        (then no key is asked alone: a pool is remote).  ``sums_out`` as for ``read``."""
        tier = lvl.tier
        inside = tier.sum_inside
        objs = parts
        copied: Optional[ReadSums] = None
        if inside:
            before = _abandoned(tier)
            tr = self._trailers.views(len(keys), _device_of(parts))
            objs = [[*p, t] for p, t in zip(parts, tr)]
            if tier.sums_copies:  # (the medium sums each chunk's bytes as it copies them, the trailer left out)
                copied = ReadSums([sum([p.numel() for p in ps]) for ps in parts])
        try:
            res = _checked(tier.read(keys, objs, copied) if copied is not None else tier.read(keys, objs), len(keys))
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s read failed: %s", lvl.name, str(e)[:300])
            return None
        sums: list[Optional[int]] = [None] * len(keys)
        bad = [i for i, ok in enumerate(res) if ok is CORRUPT]
        if inside and _abandoned(tier) != before:
            # a call abandoned meanwhile may still write into the trailers: read these, then let them go
            self._trailers.drop()
        if inside:
            got = [i for i, ok in enumerate(res) if ok is True]
            have: list[Optional[int]] = copied.sums if copied is not None else [None] * len(keys)
            left = [i for i in got if have[i] is None]  # what the medium did not sum: summed here
            for i, h in zip(left, chunk_sums([parts[i] for i in left])):
                have[i] = h
            stored = read_trailers(tr)
            for i in got:
                s = stored[i]
                if s is None or have[i] != s:
                    bad.append(i)
                else:
                    sums[i] = s
        if bad:
            res = self._corrupt(lvl, keys, res, bad)
        if sums_out is not None:
            sums_out[:] = sums
        return res

    def delete(self, lvl: Level, keys: list[str]) -> bool:
        """Delete keys from a tier; False when the medium failed (logged)."""
        try:
            lvl.tier.delete(keys)
            return True
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s delete failed: %s", lvl.name, str(e)[:300])
            return False


#: bytes a checked read of a slab copies before it hashes them (a share of a core's cache)
_CHECK_GROUP = 2 << 20


def _nbytes(objs: list[Parts]) -> int:
    return sum([p.numel() for parts in objs for p in parts])


def _groups(objs: list[Parts], limit: int) -> list[int]:
    """Cut points of ``objs`` into consecutive groups of at most ``limit`` bytes (a larger chunk alone)."""
    cuts = [0]
    size = 0
    for i, parts in enumerate(objs):
        n = sum([p.numel() for p in parts])
        if size and size + n > limit:
            cuts.append(i)
            size = 0
        size += n
    cuts.append(len(objs))
    return cuts


def _abandoned(tier: Any) -> int:
    """How many calls the medium has abandoned at their deadline so far (0 for media without deadlines)."""
    return getattr(tier, "abandoned_calls", 0)


def _device_of(objs: list[Parts]) -> Any:
    """The device of the first part of the first object (trailers go beside the chunk's bytes)."""
    for parts in objs:
        for p in parts:
            return p.device
    return None


def _checked(res: Optional[list], n: int) -> list[bool]:
    """A medium's answer of one result per key (``RuntimeError`` otherwise; None stands for none)."""
    if res is None:
        res = []
    if len(res) != n:
        raise RuntimeError(f"answered {len(res)} results for {n} keys")
    return res
