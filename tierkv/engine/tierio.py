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
recomputed from bytes nobody verified.  What a level does with them is its integrity
strategy's (``Level.integrity``, ``tierkv/engine/integrity.py``, chosen once when the
level was built): this module asks it which sums a write goes with, how the objects are
framed (a pool's trailers), what it records, and which reads fail their check; it never
looks at a medium's declarations itself.  A copy that fails its check, or that the medium
answers ``CORRUPT``, is counted ``corrupt`` for the level, recorded as a departure
(``MissReason.CORRUPT``), logged (rate-limited, naming the tier and the key) and answered
False: a miss, never bytes.  The caller drops it from a managed level (the reader does for
every failed read); a pool's copy is deleted here.
"""

from __future__ import annotations

import enum
import itertools
import logging
from typing import Optional

from tierkv.buffers import Parts, on_two_threads
from tierkv.checksum import CorruptLog, ReadSums, chunk_sums
from tierkv.engine.chain import Chain
from tierkv.engine.departures import Departures
from tierkv.engine.integrity import mismatched
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

    # ------------------------------------------------------------------ bytes
    def read(self, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]] = None,
             codes: Optional[list[int]] = None, sums_out: Optional[list[Optional[int]]] = None) -> list[bool]:
        """Read each chunk into its parts; one bool each (a medium fault or a failed check: False, never
        raised).  ``sums_out``, when given (a copy), receives each chunk's sum (None where none is known)."""
        n = len(keys)
        integrity = lvl.integrity
        got: Optional[list[Optional[int]]] = None  # each chunk's sum, hashed right after its copy
        if integrity.checks_reads and lvl.located:
            if integrity.medium_sums and ptrs is not None:  # the medium sums each chunk as it copies it
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
        if integrity.checks_reads or sums_out is not None:
            bad, sums = integrity.check_read(keys, parts, oks, got)
            if bad:
                self._corrupt(lvl, keys, oks, bad, in_place=True)
            if sums_out is not None:
                sums_out[:] = sums
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
        read from; where ``lvl``'s integrity vets a copy from it (``vets_copy_from``: an unchecked read, into a
        medium that vouches for what it stores), the bytes are checked against the sums first (a corrupt copy
        is counted at the source, never stored)."""
        integrity = lvl.integrity
        sums = integrity.sums_for_write(parts, sums)
        if sums is not None and source is not None and integrity.vets_copy_from(source.integrity):
            oks = self.check(source, keys, parts, sums)
            if False in oks:
                go = [i for i, ok in enumerate(oks) if ok]
                wrote = self.write(lvl, [keys[i] for i in go], [parts[i] for i in go], None,
                                   [sums[i] for i in go]) if go else []
                for i, ok in zip(go, wrote):
                    oks[i] = ok
                return oks
        framed = integrity.frame_write(parts, sums)
        if framed.objs is not parts:  # (framed objects are not the flat buffers ``ptrs`` vouched for)
            ptrs = None
        try:
            oks = self._bytes(Op.WRITE, lvl, keys, framed.objs, ptrs, None)
        finally:
            integrity.write_done(framed.note)
        if integrity.keeps_sums and sums is not None:
            with self._lock:
                integrity.recorded(keys, sums, oks)
        return oks

    def check(self, lvl: Level, keys: list[str], parts: list[Parts], sums: list[Optional[int]]) -> list[bool]:
        """Check bytes held by ``lvl`` (views, or a copy) against ``sums``; one bool each (a failure is
        counted corrupt for ``lvl`` and logged; the caller drops it)."""
        oks = [True] * len(keys)
        bad = mismatched(parts, sums)
        if bad:
            self._corrupt(lvl, keys, oks, bad, in_place=True)
        return oks

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
        """A shared pool's read, checked as its integrity says (``Trailers``: every object's trailer against its
        bytes); None when the medium failed (then no key is asked alone: a pool is remote).  ``sums_out`` as for
        ``read``."""
        tier = lvl.tier
        framed = lvl.integrity.frame_read(parts)
        objs, asked = framed.objs, framed.asked
        try:
            res = _checked(tier.read(keys, objs, asked) if asked is not None else tier.read(keys, objs), len(keys))
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s read failed: %s", lvl.name, str(e)[:300])
            return None
        bad = [i for i, ok in enumerate(res) if ok is CORRUPT]
        checked, sums = lvl.integrity.check_pooled(parts, res, framed)
        bad += checked
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


def _checked(res: Optional[list], n: int) -> list[bool]:
    """A medium's answer of one result per key (``RuntimeError`` otherwise; None stands for none)."""
    if res is None:
        res = []
    if len(res) != n:
        raise RuntimeError(f"answered {len(res)} results for {n} keys")
    return res
