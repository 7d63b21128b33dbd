"""ARC eviction (Adaptive Replacement Cache), sized in bytes.

Split out of ``eviction.py`` (which holds the base class, its contract and the
simpler built-ins); ``tierkv.policies.ARCPolicy`` names it.
"""

from __future__ import annotations

import sys
from typing import Optional

from .eviction import EvictionPolicy, Key, LevelOrder, _Sizes, _trim_front


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache, sized in bytes.

    T1 holds chunks seen once recently, T2 chunks seen at least twice; B1 and B2
    remember keys recently evicted from each.  A re-insert of a key found in B1
    grows the recency target ``p``, one found in B2 shrinks it, so the split
    between recency and frequency adapts to the workload.

    In a store it follows its level's order (``follow_order``): T1 is then the
    level's READY entries not in T2, in the level's order, so a chunk not read since
    it entered costs the policy nothing; T2 and the ghost lists stay its own.
    A subclass follows too unless it says ``follows_level_order = False``.
    """

    name = "arc"
    follows_level_order = True

    def __init__(self) -> None:
        super().__init__()
        # plain dicts, insertion order being list order: a re-read key is popped and put back at
        # the end; the ghost lists are trimmed from the front once per ``victims``
        self._t1: dict[Key, int] = {}  # own T1 (unused while following the level's order)
        self._t2: dict[Key, int] = {}
        self._b1: dict[Key, int] = {}
        self._b2: dict[Key, int] = {}
        self._t1_bytes = self._t2_bytes = self._b1_bytes = self._b2_bytes = 0
        self.p = 0.0  # target bytes for T1
        self._size = _Sizes()
        #: the level's order, when this policy follows it: T1 is its READY entries not in T2
        self._order: Optional[LevelOrder] = None

    def follow_order(self, order: LevelOrder) -> None:
        """Take the level's READY entries not in T2 as T1."""
        if len(self) or self._b1 or self._b2:
            raise RuntimeError(f"{type(self).__name__} already tracks keys: follow an order before first use")
        self._order = order

    def _t1b(self) -> int:
        return self._t1_bytes if self._order is None else self._order.ready_bytes() - self._t2_bytes

    def _cap(self):
        return self.capacity_bytes or max(1, self._t1b() + self._t2_bytes)

    def on_insert(self, key, nbytes):
        self.on_remove(key)
        nbytes = self._size(nbytes)
        shared = self._order is not None
        if key in self._b1:
            cap = self._cap() if not shared else self.capacity_bytes or max(1, self._t1b() - nbytes + self._t2_bytes)
            delta = max(1.0, self._b2_bytes / max(1, self._b1_bytes)) * nbytes
            self.p = min(float(cap), self.p + delta)
            self._b1_bytes -= self._b1.pop(key)
            self._t2[key] = nbytes
            self._t2_bytes += nbytes
        elif key in self._b2:
            delta = max(1.0, self._b1_bytes / max(1, self._b2_bytes)) * nbytes
            self.p = max(0.0, self.p - delta)
            self._b2_bytes -= self._b2.pop(key)
            self._t2[key] = nbytes
            self._t2_bytes += nbytes
        elif not shared:
            self._t1[key] = nbytes
            self._t1_bytes += nbytes

    def on_insert_many(self, keys, sizes):
        t1, t2, b1, b2, size = self._t1, self._t2, self._b1, self._b2, self._size
        if self._order is not None:
            # the level entered the keys in its order (T1): only a return or a ghost hit is work
            if (t2 and not t2.keys().isdisjoint(keys)) or (b1 and not b1.keys().isdisjoint(keys)) or \
                    (b2 and not b2.keys().isdisjoint(keys)):
                for key, nbytes in zip(keys, sizes):
                    if key in t2 or key in b1 or key in b2:
                        self.on_insert(key, nbytes)
            return
        if type(keys) is list and t1.keys().isdisjoint(keys) and t2.keys().isdisjoint(keys) and \
                b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            # all new (the common case): appended to T1 in order by C loops
            known = size._d.get
            shared = list(map(known, sizes))
            if None in shared:
                shared = [size(n) for n in sizes]
            t1.update(zip(keys, shared))
            self._t1_bytes += sum(shared)
            return
        add = 0
        try:
            for key, nbytes in zip(keys, sizes):
                if key in t1 or key in t2 or key in b1 or key in b2:
                    self._t1_bytes += add  # (the full rule reads the byte counts)
                    add = 0
                    self.on_insert(key, nbytes)  # a return or a ghost hit: the full rule
                else:
                    n = size(nbytes)
                    t1[key] = n
                    add += n
        finally:
            self._t1_bytes += add

    def on_access(self, key):
        t2 = self._t2
        if key in t2:
            t2[key] = t2.pop(key)
            return
        order = self._order
        if order is None:
            if key in self._t1:
                n = self._t1.pop(key)
                self._t1_bytes -= n
                t2[key] = n
                self._t2_bytes += n
            return
        fp = order.footprint(key)
        if fp >= 0:  # READY, not in T2: from T1
            n = self._size(fp)
            t2[key] = n
            self._t2_bytes += n

    def on_access_many(self, keys):
        t2, access, order = self._t2, self.on_access, self._order
        if order is not None and type(keys) is list and t2.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            fps = order.footprints(keys)
            if fps is not None:
                # first reads of distinct READY keys (the common case): from T1 to T2 by C loops
                t2.update(zip(keys, self._size.many(fps)))
                self._t2_bytes += sum(fps)
                return
        pop = t2.pop
        for key in keys:
            if key in t2:
                t2[key] = pop(key)
            else:
                access(key)

    def on_remove(self, key):
        if key in self._t2:
            self._t2_bytes -= self._t2.pop(key)
        elif self._order is None and key in self._t1:
            self._t1_bytes -= self._t1.pop(key)

    def on_remove_many(self, keys):
        t2 = self._t2
        if self._order is None:
            for key in keys:
                self.on_remove(key)
        elif t2 and not t2.keys().isdisjoint(keys):
            pop = t2.pop
            for key in keys:
                n = pop(key, None)
                if n is not None:
                    self._t2_bytes -= n

    def victims(self, nbytes, protected):
        out, freed = [], 0
        t2 = self._t2
        t1_left, t2_left = self._t1b(), self._t2_bytes
        order, p = self._order, self.p
        moved: list[Key] = []  # (level order) T2's keys met while walking T1
        it1 = iter(self._t1.items()) if order is None else iter(order)
        it2 = ((k, t2[k]) for k in t2 if k not in protected)
        to_b1: list[tuple[Key, int]] = []
        to_b2: list[tuple[Key, int]] = []
        t1_done = t2_done = False
        try:
            while freed < nbytes:
                # each step takes from the preferred list, or from the other when that one is spent
                if not t1_done and (t2_done or (t1_left > 0 and (t1_left > p or t2_left <= 0))):
                    for key, n in it1:  # a run of steps in T1
                        if order is not None and key in t2:
                            moved.append(key)
                            continue
                        if key in protected:
                            continue
                        t1_left -= n
                        out.append(key)
                        to_b1.append((key, n))
                        freed += n
                        if freed >= nbytes or not (t2_done or (t1_left > 0 and (t1_left > p or t2_left <= 0))):
                            break
                    else:
                        t1_done = True
                    continue
                got = None if t2_done else next(it2, None)
                if got is None:
                    if t1_done or t2_done:
                        return None
                    t2_done = True
                    continue
                key, n = got
                t2_left -= n
                out.append(key)
                to_b2.append((key, n))
                freed += n
        finally:
            if order is not None:
                order.move_to_end(moved)
        if out:
            b1, b2 = self._b1, self._b2
            cap = self._cap()
            if b1.keys().isdisjoint(out) and b2.keys().isdisjoint(out):
                # each victim to its ghost list's end in order, then both trimmed from the front:
                # the same lists as trimming both after each one
                b1.update(to_b1)
                b2.update(to_b2)
                self._b1_bytes = _trim_front(b1, self._b1_bytes + sum(n for _, n in to_b1), cap)
                self._b2_bytes = _trim_front(b2, self._b2_bytes + sum(n for _, n in to_b2), cap)
            else:  # a victim named before and not evicted is in a ghost list already: one at a time
                t1n = dict(to_b1)
                for key in out:
                    if key in t1n:
                        b1[key] = n = t1n[key]
                        self._b1_bytes += n
                    else:
                        b2[key] = n = t2[key]
                        self._b2_bytes += n
                    self._b1_bytes = _trim_front(b1, self._b1_bytes, cap)
                    self._b2_bytes = _trim_front(b2, self._b2_bytes, cap)
        return out

    def __len__(self):
        if self._order is not None:
            return self._order.ready_count()
        return len(self._t1) + len(self._t2)

    def memory_bytes(self) -> int:
        return sum(sys.getsizeof(d) for d in (self._t1, self._t2, self._b1, self._b2, self._size._d))

    def counters(self) -> dict[str, int]:
        order = self._order
        return {"tracked": len(self), "t1": len(self) - len(self._t2), "t1_bytes": self._t1b(),
                "t2": len(self._t2), "t2_bytes": self._t2_bytes, "b1": len(self._b1), "b1_bytes": self._b1_bytes,
                "b2": len(self._b2), "b2_bytes": self._b2_bytes, "p": int(self.p),
                "follows_level_order": int(order is not None)}
