"""S3-FIFO eviction: a small probationary FIFO, a main FIFO and a ghost FIFO.

Split out of ``eviction.py`` (which holds the base class, its contract and the
simpler built-ins); ``tierkv.policies.eviction.S3FIFOPolicy`` still names it.
"""

from __future__ import annotations

from collections import OrderedDict

from .eviction import EvictionPolicy, Key, _Sizes


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
        self._freq: dict[Key, int] = {}  # only keys read since they entered a queue (absent: 0)
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0
        self._size = _Sizes()

    def on_insert(self, key, nbytes):
        self.on_remove(key)
        nbytes = self._size(nbytes)
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = nbytes
            self._main_bytes += nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def on_insert_many(self, keys, sizes):
        small, main, ghost, size = self._small, self._main, self._ghost, self._size
        small_add = main_add = 0
        try:
            for key, nbytes in zip(keys, sizes):
                if key in small or key in main:
                    self.on_remove(key)
                nbytes = size(nbytes)
                if key in ghost:
                    self._ghost_bytes -= ghost.pop(key)
                    main[key] = nbytes
                    main_add += nbytes
                else:
                    small[key] = nbytes
                    small_add += nbytes
        finally:
            self._small_bytes += small_add
            self._main_bytes += main_add

    def on_access(self, key):
        if key in self._small or key in self._main:
            freq = self._freq.get(key, 0)
            if freq < 3:
                self._freq[key] = freq + 1

    def on_access_many(self, keys):
        small, main, get, freq = self._small, self._main, self._freq.get, self._freq
        for key in keys:
            if key in small or key in main:
                f = get(key, 0)
                if f < 3:
                    freq[key] = f + 1

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
        # chosen and skipped keys never change queue during the walk: count them per queue
        closed_small = closed_main = 0
        while freed < nbytes and budget > 0:
            budget -= 1
            small_open = len(self._small) > closed_small
            main_open = len(self._main) > closed_main
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
                    closed_small += 1
                    small_left -= n  # cannot leave small: do not let it hold eviction there
                else:
                    closed_main += 1
                continue
            freq = self._freq.get(key, 0)
            if freq > 0:
                if from_small:  # read while on probation: graduate to main
                    del self._small[key]
                    self._small_bytes -= n
                    small_left -= n
                    self._main[key] = n
                    self._main_bytes += n
                    del self._freq[key]
                elif freq == 1:
                    del self._freq[key]
                else:
                    self._freq[key] = freq - 1
                continue
            chosen.add(key)
            out.append(key)
            freed += n
            if from_small:
                closed_small += 1
                small_left -= n
            else:
                closed_main += 1
        if freed < nbytes:
            return None
        for key in out:
            self._remember(key, self._small[key] if key in self._small else self._main[key])
        return out

    def __len__(self):
        return len(self._small) + len(self._main)
