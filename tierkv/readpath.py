"""How ``TieredStore`` reads: the fastest level holding each key, pinned while read; then the shared tiers.

Part of ``TieredStore`` (a mixin it inherits), split out so each module holds one
concern.  A read pins its entries under the store's lock, reads outside it, and
unpins every entry in a ``finally``; a failed or corrupt copy is dropped and the
next level holding the key is tried.  Shared (unmanaged) tiers are asked in chain
order, each only for the keys no earlier one had (``_first_shared``, the one
fan-out that ``get``, ``lookup``, ``locate`` and ``contains`` use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from tierkv.buffers import Parts, check_size
from tierkv.hooks import call_policy
from tierkv.keys import check_key
from tierkv.level import _NB_MASK, Level

_INT = {int}


class ReadPath:
    """The read path of ``TieredStore`` (see the module docstring)."""

    levels: list[Level]
    _lock: Any
    _managed_levels: list[int]
    _counters: Any
    _admissions: list[Any]
    _shared_levels: list[int]

    if TYPE_CHECKING:  # defined by ``Placement`` and ``Copying``
        def _tier_io(self, lvl: Level, op: str, keys: list[str], parts: list[Parts],
                     ptrs: Optional[list[int]] = None, codes: Optional[list[int]] = None) -> list[bool]: ...
        def _tier_ask(self, lvl: Level, op: str, keys: list[str],
                      parts: Optional[list[Parts]] = None) -> Optional[list]: ...
        def _promote(self, keys: list[str], prepared: list[tuple[Parts, int]],
                     served: list[Optional[int]]) -> None: ...

    def _get(self, keys: list[str], prepared: list[tuple[Parts, int]],
             ptrs: Optional[list[int]] = None) -> list[bool]:
        """Read ``keys`` into ``prepared`` (``ptrs``: their host addresses, see ``to_parts_ptrs``)."""
        n = len(keys)
        results = [False] * n
        served: list[Optional[int]] = [None] * n
        managed = [(j, self.levels[j].index) for j in self._managed_levels]
        tried: list[int] = [0] * n  # bitmask of levels already tried for key i
        no_local: list[int] = []
        pending: list[int] = []
        groups: dict[int, list[int]] = {}  # level -> indexes into keys of the entries pinned there
        hit_codes: Optional[list[int]] = None  # the one managed level's codes of its hits, as probed
        with self._lock:
            self._counters.get_calls += 1
            # sizes checked before anything is pinned: the first level holding a key must hold its size
            whole = False  # every key READY in the one managed level, sizes matching: no per-key work
            if len(managed) == 1:  # one managed level: one probe a key
                j, index = managed[0]
                bit, hits, hit_codes = 1 << j, [], []
                vals: list[Any] = list(map(index.get, keys))
                if (n and set(map(type, vals)) == _INT and min(vals) > 0
                        and (fields := [v >> 1 & _NB_MASK for v in vals]) == [p[1] for p in prepared]
                        and _NB_MASK not in fields):  # (a field at the marker: a large chunk, sized elsewhere)
                    whole = True
                    hits, hit_codes, vals = list(range(n)), vals, []
                for i, v in enumerate(vals):
                    if type(v) is int and v > 0:
                        f = v >> 1 & _NB_MASK
                        if f != prepared[i][1] or f == _NB_MASK:  # (a large chunk: its size asked in full)
                            check_size(keys[i], prepared[i][1], self.levels[j].value_nbytes(v))
                        hits.append(i)
                        hit_codes.append(v)
                    else:
                        check_key(keys[i])
                        no_local.append(i)
                if hits:
                    groups[j] = hits
                    tried = [bit] * n  # (only hits are ever retried)
            for i, key in enumerate(keys if len(managed) != 1 else ()):  # none, or several managed levels
                for j, index in managed:
                    v = index.get(key)
                    if type(v) is int and v > 0:
                        nb = self.levels[j].value_nbytes(v)
                        if nb != prepared[i][1]:
                            check_size(key, prepared[i][1], nb)
                        tried[i] = 1 << j
                        g = groups.get(j)
                        if g is None:
                            g = groups[j] = []
                        g.append(i)
                        break
                else:
                    check_key(key)
                    no_local.append(i)
            if self._admissions:
                for key in keys:
                    for adm in self._admissions:
                        call_policy(adm, "on_access", "*", key)
            for j, items in groups.items():
                self.levels[j].pin_many(keys if whole else [keys[i] for i in items])
        first = True
        while first or pending:
            if not first:
                groups = {}
            try:
                if not first:
                    with self._lock:
                        for i in pending:
                            key, want, found = keys[i], prepared[i][1], -1
                            for j, _ in managed:
                                if tried[i] >> j & 1:
                                    continue
                                nb = self.levels[j].ready_nbytes(key)
                                if nb < 0:
                                    continue
                                tried[i] |= 1 << j
                                if nb == want:
                                    found = j
                                    break
                            if found < 0:
                                no_local.append(i)
                                continue
                            self.levels[found].pin(key)
                            g = groups.get(found)
                            if g is None:
                                g = groups[found] = []
                            g.append(i)
                pending = []
                for j, items in groups.items():
                    lvl = self.levels[j]
                    whole_now = first and whole
                    names = keys if whole_now else [keys[i] for i in items]
                    # (sizes matched above; a pinned chunk keeps its code, so the probe's codes still hold)
                    oks = self._tier_io(lvl, "read", names,
                                        [p[0] for p in prepared] if whole_now else [prepared[i][0] for i in items],
                                        None if ptrs is None or not lvl.located else
                                        ptrs if whole_now else [ptrs[i] for i in items],
                                        hit_codes if first and lvl.located and len(managed) == 1 else None)
                    with self._lock:
                        index = lvl.index
                        if False not in oks and set(map(type, map(index.get, names))) == _INT:
                            # all read, none dropped meanwhile (the common case)
                            if whole_now:
                                results[:] = [True] * n
                                served[:] = [j] * n
                            else:
                                for i in items:
                                    results[i] = True
                                    served[i] = j
                            lvl.counters.bytes_read += sum([prepared[i][1] for i in items])
                            lvl.counters.hits += len(items)
                            lvl.accessed(names)
                            continue
                        hit = []
                        got = 0
                        for i, ok in zip(items, oks):
                            key = keys[i]
                            if ok and type(index.get(key)) is int:  # (a chunk dropped while read is an Entry)
                                results[i] = True
                                served[i] = j
                                hit.append(key)
                                got += prepared[i][1]
                            else:  # lost, torn or corrupt: drop this copy, try the next level
                                if not ok:
                                    lvl.counters.errors += 1
                                    lvl.drop(key)
                                pending.append(i)
                        lvl.counters.bytes_read += got
                        lvl.counters.hits += len(hit)
                        lvl.accessed(hit)
            finally:
                all_pinned = first and whole  # (the first pass pinned every key, in order)
                first = False
                with self._lock:
                    for j, items in groups.items():
                        self.levels[j].unpin_many(keys if all_pinned else [keys[i] for i in items])
        if no_local and self._shared_levels:
            self._read_shared(keys, prepared, [i for i in no_local if not results[i]], results, served)
        self._count_misses(served, prepared)
        if served.count(None) + served.count(0) < n:  # something was served below the top level
            self._promote(keys, prepared, served)
        return results

    def _count_misses(self, served: list[Optional[int]], prepared: list[tuple[Parts, int]]) -> None:
        """Misses per level consulted: every available level above the one that served."""
        nlev = len(self.levels)
        available = [lvl.tier.available for lvl in self.levels]
        missed_above = [served.count(k) for k in range(nlev)] + [served.count(None)]
        got = 0
        if missed_above[nlev] == 0:
            got = sum([p[1] for p in prepared])
        elif missed_above[nlev] < len(served):
            got = sum([p[1] for p, j in zip(prepared, served) if j is not None])
        with self._lock:
            below = 0  # keys served at or below level k (or not at all)
            for k in range(nlev, -1, -1):
                if k < nlev and available[k]:
                    self.levels[k].counters.misses += below
                below += missed_above[k]
            self._counters.misses += missed_above[nlev]
            self._counters.hits += len(served) - missed_above[nlev]
            self._counters.bytes_got += got

    def _first_shared(self, op: str, keys: list[str], idx: list[int],
                      parts: Optional[list[Parts]] = None) -> dict[int, int]:
        """Ask the shared (unmanaged) levels in chain order, each for the keys no earlier one had.

        Returns {index into keys: level that answered True}.  ``op`` is "read" (with
        ``parts``) or "contains"; a level that fails or is down is skipped.
        """
        found: dict[int, int] = {}
        left = list(idx)
        for j in self._shared_levels:
            if not left:
                break
            lvl = self.levels[j]
            if not lvl.tier.available:
                continue
            res = self._tier_ask(lvl, op, [keys[i] for i in left],
                                 [parts[i] for i in left] if parts is not None else None)
            if res is None:
                continue
            for i, hit in zip(left, res):
                if hit:
                    found[i] = j
            left = [i for i in left if i not in found]
        return found

    def _read_shared(self, keys, prepared, idx: list[int], results: list[bool], served: list[Optional[int]]) -> None:
        found = self._first_shared("read", keys, idx, [p for p, _ in prepared])
        with self._lock:
            for i, j in found.items():
                results[i] = True
                served[i] = j
                self.levels[j].counters.hits += 1
                self.levels[j].counters.bytes_read += prepared[i][1]

