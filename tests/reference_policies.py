"""A frozen copy of the built-in eviction policies as they were before their metadata was compacted.

The differential test (``tests/test_policy_differential.py``) replays random traces
against these and the live policies and requires the same victims, in the same
order.  Do not edit: this file is the reference behaviour.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable
from typing import Optional

from sortedcontainers import SortedList

Key = Hashable


class EvictionPolicy:
    """Base class: implement ``on_insert``, ``on_access``, ``on_remove``, ``victims``."""

    #: config name (``"eviction": "lru"``)
    name = "custom"

    def __init__(self) -> None:
        #: capacity of the tier this policy serves; set by the store before first use
        self.capacity_bytes: Optional[int] = None

    def on_insert(self, key: Key, nbytes: int) -> None:
        """A chunk of ``nbytes`` became readable in the tier."""
        raise NotImplementedError

    def on_access(self, key: Key) -> None:
        """A chunk was read from the tier."""
        raise NotImplementedError

    def on_remove(self, key: Key) -> None:
        """A chunk left the tier (evicted, removed or found corrupt)."""
        raise NotImplementedError

    def victims(self, nbytes: int, protected: Container[Key]) -> Optional[list[Key]]:
        """Keys to evict, in order, freeing ≥ ``nbytes`` without touching ``protected``; None if impossible."""
        raise NotImplementedError

    def __len__(self) -> int:  # optional: how many chunks the policy tracks
        return 0


def _take(order, sizes: dict, nbytes: int, protected: Container[Key]) -> Optional[list[Key]]:
    """Walk ``order`` collecting unprotected keys until ``nbytes`` are covered."""
    out, freed = [], 0
    if nbytes <= 0:
        return out
    for key in order:
        if key in protected:
            continue
        out.append(key)
        freed += sizes[key]
        if freed >= nbytes:
            return out
    return None


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._od: OrderedDict[Key, int] = OrderedDict()

    def on_insert(self, key, nbytes):
        self._od[key] = nbytes
        self._od.move_to_end(key)

    def on_access(self, key):
        if key in self._od:
            self._od.move_to_end(key)

    def on_remove(self, key):
        self._od.pop(key, None)

    def victims(self, nbytes, protected):
        return _take(iter(self._od), self._od, nbytes, protected)

    def __len__(self):
        return len(self._od)


class FIFOPolicy(LRUPolicy):
    """First in, first out: reads do not refresh a chunk."""

    name = "fifo"

    def on_access(self, key):
        pass


class LFUPolicy(EvictionPolicy):
    """Least frequently used first; ties go to the oldest access."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._meta: dict[Key, tuple[int, int]] = {}  # key -> (freq, tick)
        self._sizes: dict[Key, int] = {}
        self._order = SortedList()  # (freq, tick, key)
        self._tick = 0

    def _set(self, key, freq):
        self._tick += 1
        self._meta[key] = (freq, self._tick)
        self._order.add((freq, self._tick, key))

    def on_insert(self, key, nbytes):
        if key in self._meta:
            self.on_remove(key)
        self._sizes[key] = nbytes
        self._set(key, 1)

    def on_access(self, key):
        meta = self._meta.get(key)
        if meta is None:
            return
        self._order.remove((meta[0], meta[1], key))
        self._set(key, meta[0] + 1)

    def on_remove(self, key):
        meta = self._meta.pop(key, None)
        if meta is not None:
            self._order.remove((meta[0], meta[1], key))
            del self._sizes[key]

    def victims(self, nbytes, protected):
        return _take((k for _, _, k in self._order), self._sizes, nbytes, protected)

    def __len__(self):
        return len(self._meta)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: a small probationary FIFO, a main FIFO and a ghost FIFO of recent evictees.

    New chunks enter the small queue (10% of bytes).  A chunk read while in the
    small queue moves to main when it reaches the head; one never read is evicted
    and remembered in the ghost queue, and a ghost that comes back goes straight
    to main.  Main is a FIFO with a 2-bit frequency: a read chunk at the head is
    reinserted with its frequency decremented.  One-hit wonders leave quickly.
    """

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1) -> None:
        super().__init__()
        if not 0 < small_ratio < 1:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        self.small_ratio = small_ratio
        self._small: OrderedDict[Key, int] = OrderedDict()
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0

    def on_insert(self, key, nbytes):
        self.on_remove(key)
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = nbytes
            self._main_bytes += nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def on_access(self, key):
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, 3)

    def on_remove(self, key):
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        elif key in self._main:
            self._main_bytes -= self._main.pop(key)
        else:
            return
        self._freq.pop(key, None)

    def _remember(self, key, nbytes):
        self._ghost[key] = nbytes
        self._ghost_bytes += nbytes
        limit = self.capacity_bytes or (self._small_bytes + self._main_bytes)
        while self._ghost and self._ghost_bytes > limit:
            _, n = self._ghost.popitem(last=False)
            self._ghost_bytes -= n

    def victims(self, nbytes, protected):
        out: list[Key] = []
        chosen: set[Key] = set()
        skipped: set[Key] = set()  # protected keys met on the way
        freed = 0
        small_target = self.small_ratio * (self.capacity_bytes or (self._small_bytes + self._main_bytes))
        small_left = self._small_bytes  # bytes in small not yet chosen
        # Bounded: every queued chunk is looked at a few times at most, so a queue
        # full of protected chunks ends in None rather than a spin.
        budget = 4 * (len(self._small) + len(self._main)) + 8
        while freed < nbytes and budget > 0:
            budget -= 1
            small_open = len(self._small) > len(chosen & self._small.keys()) + len(skipped & self._small.keys())
            main_open = len(self._main) > len(chosen & self._main.keys()) + len(skipped & self._main.keys())
            if not small_open and not main_open:
                break
            from_small = small_open and (small_left > small_target or not main_open)
            queue = self._small if from_small else self._main
            key = next(iter(queue))
            if key in chosen or key in skipped:  # those sit at the tail; the head is open while any is
                key = next(k for k in queue if k not in chosen and k not in skipped)
            n = queue[key]
            queue.move_to_end(key)
            if key in protected:
                skipped.add(key)
                if from_small:
                    small_left -= n  # cannot leave small: do not let it hold eviction there
                continue
            if self._freq.get(key, 0) > 0:
                if from_small:  # read while on probation: graduate to main
                    del self._small[key]
                    self._small_bytes -= n
                    small_left -= n
                    self._main[key] = n
                    self._main_bytes += n
                    self._freq[key] = 0
                else:
                    self._freq[key] -= 1
                continue
            chosen.add(key)
            out.append(key)
            freed += n
            if from_small:
                small_left -= n
        if freed < nbytes:
            return None
        for key in out:
            self._remember(key, self._small.get(key) or self._main.get(key))
        return out

    def __len__(self):
        return len(self._small) + len(self._main)


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
        self._t1: OrderedDict[Key, int] = OrderedDict()
        self._t2: OrderedDict[Key, int] = OrderedDict()
        self._b1: OrderedDict[Key, int] = OrderedDict()
        self._b2: OrderedDict[Key, int] = OrderedDict()
        self._t1_bytes = self._t2_bytes = self._b1_bytes = self._b2_bytes = 0
        self.p = 0.0  # target bytes for T1

    def _cap(self):
        return self.capacity_bytes or max(1, self._t1_bytes + self._t2_bytes)

    # same shape as S3FIFOPolicy.on_insert: each policy keeps its own lists (a reference model reads plainest whole)
    def on_insert(self, key, nbytes):
        self.on_remove(key)
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

    def on_access(self, key):
        if key in self._t1:
            n = self._t1.pop(key)
            self._t1_bytes -= n
            self._t2[key] = n
            self._t2_bytes += n
        elif key in self._t2:
            self._t2.move_to_end(key)

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


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
}
