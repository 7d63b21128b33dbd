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
"""

from __future__ import annotations

import enum
import logging
from typing import Optional

from tierkv.buffers import Parts
from tierkv.engine.chain import Chain
from tierkv.engine.level import Level
from tierkv.errors import StoreClosedError

log = logging.getLogger("tierkv")


class Op(enum.Enum):
    """What the engine asks of a tier."""

    READ = "read"
    WRITE = "write"
    CONTAINS = "contains"
    DELETE = "delete"


class TierIO:
    """The engine's typed calls into media (see the module docstring)."""

    def __init__(self, chain: Chain) -> None:
        self._lock = chain.lock

    # ------------------------------------------------------------------ bytes
    def read(self, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]] = None,
             codes: Optional[list[int]] = None) -> list[bool]:
        """Read each chunk into its parts; one bool each (a medium fault: False, never raised)."""
        return self._bytes(Op.READ, lvl, keys, parts, ptrs, codes)

    def write(self, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]] = None) -> list[bool]:
        """Write each chunk from its parts (reserved by the caller in a managed level); one bool each."""
        return self._bytes(Op.WRITE, lvl, keys, parts, ptrs, None)

    def _bytes(self, op: Op, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]],
               codes: Optional[list[int]]) -> list[bool]:
        try:
            return self._batch(op, lvl, keys, parts, ptrs, codes)
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s %s failed: %s", lvl.name, op.value, str(e)[:300])
            if len(keys) > 1 and lvl.managed and lvl.tier.available:
                # one chunk's fault never costs the others: a local medium is asked again key by key
                return self._one_by_one(op, lvl, keys, parts, ptrs, codes)
            return [False] * len(keys)

    def _batch(self, op: Op, lvl: Level, keys: list[str], parts: list[Parts], ptrs: Optional[list[int]],
               codes: Optional[list[int]]) -> list[bool]:
        tier = lvl.tier
        if lvl.located:
            if codes is None:
                with self._lock:
                    codes = lvl.codes(keys)
            if op is Op.WRITE:
                tier.write_at(codes, parts, ptrs)
                return [True] * len(keys)
            res = tier.read_at(codes, parts, ptrs)
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
            out.append(bool(ok))
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

    def read_unmanaged(self, lvl: Level, keys: list[str], parts: list[Parts]) -> Optional[list[bool]]:
        """A shared pool's read; None when the medium failed (then no key is asked alone: a pool is remote)."""
        try:
            return _checked(lvl.tier.read(keys, parts), len(keys))
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s read failed: %s", lvl.name, str(e)[:300])
            return None

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


def _checked(res: Optional[list], n: int) -> list[bool]:
    """A medium's answer of one result per key (``RuntimeError`` otherwise; None stands for none)."""
    if res is None:
        res = []
    if len(res) != n:
        raise RuntimeError(f"answered {len(res)} results for {n} keys")
    return res
