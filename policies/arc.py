"""ARC eviction (Adaptive Replacement Cache), sized in bytes.

Split out of ``eviction.py`` (which holds the base class, its contract and the
simpler built-ins); ``tierkv.policies.eviction.ARCPolicy`` still names it.
"""

from __future__ import annotations

from collections import OrderedDict

from .eviction import EvictionPolicy, Key, _Sizes


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache, sized in bytes.

    T1 holds chunks seen once recently, T2 chunks seen at least twice; B1 and B2
    remember keys recently evicted from each.  A re-insert of a key found in B1
    grows the recency target ``p``, one found in B2 shrinks it, so the split
    between recency and frequency adapts to the workload.
    """

    name = "arc"

    def __init__(self) -> None:
        super().__init__()
        # T1 and T2 are plain dicts (a re-read key is popped and put back at the end); the ghost
        # lists, trimmed from the front one key at a time, stay ordered dicts
        self._t1: dict[Key, int] = {}
        self._t2: dict[Key, int] = {}
        self._b1: OrderedDict[Key, int] = OrderedDict()
        self._b2: OrderedDict[Key, int] = OrderedDict()
        self._t1_bytes = self._t2_bytes = self._b1_bytes = self._b2_bytes = 0
        self.p = 0.0  # target bytes for T1
        self._size = _Sizes()

    def _cap(self):
        return self.capacity_bytes or max(1, self._t1_bytes + self._t2_bytes)

    def on_insert(self, key, nbytes):
        self.on_remove(key)
        nbytes = self._size(nbytes)
        cap = self._cap()
        if key in self._b1:
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
        else:
            self._t1[key] = nbytes
            self._t1_bytes += nbytes

    def on_insert_many(self, keys, sizes):
        t1, t2, b1, b2, size = self._t1, self._t2, self._b1, self._b2, self._size
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

    def on_access_many(self, keys):
        for key in keys:
            self.on_access(key)

    def on_access(self, key):
        if key in self._t1:
            n = self._t1.pop(key)
            self._t1_bytes -= n
            self._t2[key] = n
            self._t2_bytes += n
        elif key in self._t2:
            self._t2[key] = self._t2.pop(key)

    def on_remove(self, key):
        if key in self._t1:
            self._t1_bytes -= self._t1.pop(key)
        elif key in self._t2:
            self._t2_bytes -= self._t2.pop(key)

    def _ghost(self, which, key, n):
        ghost = self._b1 if which == 1 else self._b2
        ghost[key] = n
        if which == 1:
            self._b1_bytes += n
        else:
            self._b2_bytes += n
        cap = self._cap()
        while self._b1 and self._b1_bytes > cap:
            self._b1_bytes -= self._b1.popitem(last=False)[1]
        while self._b2 and self._b2_bytes > cap:
            self._b2_bytes -= self._b2.popitem(last=False)[1]

    def victims(self, nbytes, protected):
        out, freed = [], 0
        t1_left, t2_left = self._t1_bytes, self._t2_bytes
        it1 = (k for k in self._t1 if k not in protected)
        it2 = (k for k in self._t2 if k not in protected)
        src = {}
        while freed < nbytes:
            prefer_t1 = t1_left > 0 and (t1_left > self.p or t2_left <= 0)
            key = None
            for first in ((it1, it2) if prefer_t1 else (it2, it1)):
                key = next(first, None)
                if key is not None:
                    break
            if key is None:
                return None
            in_t1 = key in self._t1
            n = self._t1[key] if in_t1 else self._t2[key]
            if in_t1:
                t1_left -= n
            else:
                t2_left -= n
            src[key] = (1 if in_t1 else 2, n)
            out.append(key)
            freed += n
        for key in out:
            which, n = src[key]
            self._ghost(which, key, n)
        return out

    def __len__(self):
        return len(self._t1) + len(self._t2)
