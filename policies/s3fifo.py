"""S3-FIFO eviction: a small probationary FIFO, a main FIFO and a ghost FIFO.

Split out of ``eviction.py`` (which holds the base class, its contract and the
simpler built-ins); ``tierkv.policies.S3FIFOPolicy`` names it.
"""

from __future__ import annotations

import sys
from itertools import repeat
from typing import Optional

from .eviction import EvictionPolicy, Key, LevelOrder, _Sizes, _trim_front


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: a small probationary FIFO, a main FIFO and a ghost FIFO of recent evictees.

    New chunks enter the small queue (10% of bytes).  A chunk read while in the
    small queue moves to main when it reaches the head; one never read is evicted
    and remembered in the ghost queue, and a ghost that comes back goes straight
    to main.  Main is a FIFO with a 2-bit frequency: a read chunk at the head is
    reinserted with its frequency decremented.  One-hit wonders leave quickly.

    Memory: small, main and the ghost are plain dicts (key -> size; insertion order
    is queue order; the ghost is trimmed from its front once per ``victims``), and the
    frequency is kept only for keys read since they entered a queue.  In a store it follows
    its level's order (``follow_order``), as LRU and FIFO do: the small queue is then the
    level's entries themselves (the READY ones not in main, in the level's order), so a
    chunk that was never read since it entered costs the policy nothing; only main, the
    read keys' frequencies and the ghost are the policy's own.  A chunk's place in small
    is then its reservation rather than its commit (the same whenever one writer at a time
    commits what it reserved, as a store does under its lock).  A subclass follows too
    unless it says ``follows_level_order = False``.

    ``victims`` walks each queue forward once and applies its moves after the walk,
    which leaves the same queues as moving each key as it is met.
    """

    name = "s3fifo"
    follows_level_order = True

    def __init__(self, small_ratio: float = 0.1) -> None:
        super().__init__()
        if not 0 < small_ratio < 1:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        self.small_ratio = small_ratio
        self._small: dict[Key, int] = {}  # own small queue (unused while following the level's order)
        self._main: dict[Key, int] = {}
        self._ghost: dict[Key, int] = {}
        self._freq: dict[Key, int] = {}  # only keys read since they entered a queue (absent: 0)
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0
        self._size = _Sizes()
        #: the level's order, when this policy follows it: the small queue is its READY entries not in main
        self._order: Optional[LevelOrder] = None
        #: (level order) keys went to the order's end while reservations were out: a commit goes behind them
        self._stale = False

    def follow_order(self, order: LevelOrder) -> None:
        """Take the level's READY entries not in main as the small queue (its ``ready_bytes`` counts them:
        the policy cannot look a key up once the level has let it go)."""
        if len(self) or self._ghost:
            raise RuntimeError(f"{type(self).__name__} already tracks keys: follow an order before first use")
        self._order = order

    # -- hooks -----------------------------------------------------------------------
    def _tracked(self, key) -> bool:
        order = self._order
        if order is None:
            return key in self._small or key in self._main
        return order.footprint(key) >= 0

    def _commit_order(self, keys) -> None:
        """(level order) Put newly READY ``keys`` at the order's end if keys went there since they were reserved."""
        order = self._order
        if order is not None and self._stale:
            order.move_to_end(list(dict.fromkeys(keys)))
            if order.settled():  # no reservation left out
                self._stale = False

    def on_insert(self, key, nbytes):
        if self._order is not None:
            self._commit_order((key,))
            self._enter_shared(key, nbytes)
            return
        self.on_remove(key)
        nbytes = self._size(nbytes)
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = nbytes
            self._main_bytes += nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def _enter_shared(self, key, nbytes) -> None:
        """(level order) ``key`` is READY in the level's order, so in small unless it comes back from the ghost."""
        if key in self._main:
            self.on_remove(key)
        else:
            self._freq.pop(key, None)
        ghost = self._ghost
        if key in ghost:
            nbytes = self._size(nbytes)
            self._ghost_bytes -= ghost.pop(key)
            self._main[key] = nbytes
            self._main_bytes += nbytes

    def on_insert_many(self, keys, sizes):
        if self._order is not None:
            # the level entered the keys in its order (the small queue); only a return to main is work
            self._commit_order(keys)
            if (self._ghost and not self._ghost.keys().isdisjoint(keys)) or \
                    (self._main and not self._main.keys().isdisjoint(keys)) or \
                    (self._freq and not self._freq.keys().isdisjoint(keys)):
                for key, nbytes in zip(keys, sizes):
                    self._enter_shared(key, nbytes)
            return
        small, main, ghost, size, known = self._small, self._main, self._ghost, self._size, self._size._d.get
        if type(keys) is list and small.keys().isdisjoint(keys) and main.keys().isdisjoint(keys) and \
                ghost.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            # all new (the common case): appended to small in order by C loops
            shared = list(map(known, sizes))
            if None in shared:
                shared = [size(n) for n in sizes]
            small.update(zip(keys, shared))
            self._small_bytes += sum(shared)
            return
        for key, nbytes in zip(keys, sizes):
            self.on_insert(key, nbytes)

    def on_access(self, key):
        if self._tracked(key):
            freq = self._freq.get(key, 0)
            if freq < 3:
                self._freq[key] = freq + 1

    def on_access_many(self, keys):
        freq = self._freq
        if type(keys) is list and len(set(keys)) == len(keys):
            # distinct keys, all tracked (the store's reads): one C loop each
            order = self._order
            if order is not None:
                ok = order.footprints(keys) is not None
            else:
                small, main = self._small, self._main
                ok = all(k in small or k in main for k in keys)
            if ok:
                old = list(map(freq.get, keys, repeat(0)))
                if max(old, default=0) < 3:
                    freq.update(zip(keys, map((1).__add__, old)))
                    return
        tracked, get = self._tracked, freq.get
        for key in keys:
            if tracked(key):
                f = get(key, 0)
                if f < 3:
                    freq[key] = f + 1

    def on_remove(self, key):
        if self._order is None and key in self._small:
            self._small_bytes -= self._small.pop(key)
        elif key in self._main:
            self._main_bytes -= self._main.pop(key)
        elif self._order is None:
            return
        self._freq.pop(key, None)

    def on_remove_many(self, keys):
        main, freq = self._main, self._freq
        if self._order is None:
            small = self._small
            for key in keys:
                if key in small:
                    self._small_bytes -= small.pop(key)
                elif key in main:
                    self._main_bytes -= main.pop(key)
                else:
                    continue
                freq.pop(key, None)
            return
        if main and not main.keys().isdisjoint(keys):
            gone = [n for n in map(main.pop, keys, repeat(None)) if n is not None]
            self._main_bytes -= sum(gone)
        if freq:
            list(map(freq.pop, keys, repeat(None)))

    # -- eviction --------------------------------------------------------------------
    def victims(self, nbytes, protected):
        out: list[Key] = []
        if nbytes <= 0:
            return out
        order, main, freq = self._order, self._main, self._freq
        main_bytes = self._main_bytes
        if order is None:
            small_bytes, small_n = self._small_bytes, len(self._small)
        else:
            small_bytes, small_n = order.ready_bytes() - main_bytes, order.ready_count() - len(main)
        small_target = self.small_ratio * (self.capacity_bytes or (small_bytes + main_bytes))
        small_left = small_bytes  # bytes in small not yet chosen
        main_n = len(main)
        # Bounded: every queued chunk is looked at a few times at most, so a queue
        # full of protected chunks ends in None rather than a spin.
        budget = 4 * (small_n + main_n) + 8
        # Each queue is walked forward once, unchanged during the walk; what the walk moves
        # is applied after it.  A key the walk has chosen or skipped (protected) is closed:
        # counted per queue, so a queue is open while it holds a key not yet closed.
        closed_small = closed_main = 0
        blockers: list[Key] = []  # (level order) main's keys met in the order while walking small
        small_it = iter(self._small.items()) if order is None else iter(order)
        small_moved: list[Key] = []  # to small's tail, in order (skipped and chosen keys)
        skipped: list[Key] = []  # of those, the skipped (protected) ones
        graduated: list[Key] = []
        main_it = iter(main.items())
        main_orig = main_n  # main's keys at the start not yet met
        # main's tail as the walk leaves it: [key, size, state] (0 open, 1 closed, 2 moved on)
        tail: list[list] = []
        head = 0  # the first entry of ``tail`` not yet passed (once main's first keys are all met)
        out_n: list[int] = []  # the victims' sizes
        freed = 0
        while freed < nbytes and budget > 0:
            budget -= 1
            small_open = small_n > closed_small
            main_open = main_n > closed_main
            if not small_open and not main_open:
                break
            if small_open and (small_left > small_target or not main_open):
                # a run of steps in small (a key of main met in the level's order is no step: skipped)
                for key, n in small_it:
                    if order is not None and key in main:
                        blockers.append(key)
                        continue
                    small_left -= n
                    if key in protected:
                        small_moved.append(key)
                        skipped.append(key)
                        closed_small += 1  # cannot leave small: do not let it hold eviction there
                    elif key in freq:  # read while on probation: graduate to main
                        del freq[key]
                        graduated.append(key)
                        small_n -= 1
                        small_bytes -= n
                        main_n += 1
                        main_bytes += n
                        tail.append([key, n, 0])
                    else:
                        small_moved.append(key)
                        out.append(key)
                        out_n.append(n)
                        freed += n
                        closed_small += 1
                    # is the next step one in small too?  (else the loop above decides)
                    if freed >= nbytes or budget <= 0 or small_n <= closed_small or \
                            (small_left <= small_target and main_n > closed_main):
                        break
                    budget -= 1
                else:  # (cannot happen while the counts are right)
                    break
                continue
            if main_orig:
                key, n = next(main_it)
                main_orig -= 1
            else:
                while tail[head][2]:  # closed keys stay where they are; moved ones are further on
                    head += 1
                entry = tail[head]
                entry[2] = 2
                head += 1
                key, n = entry[0], entry[1]
            if key in protected:
                tail.append([key, n, 1])
                closed_main += 1
                continue
            f = freq.get(key)
            if f:
                if f == 1:
                    del freq[key]
                else:
                    freq[key] = f - 1
                tail.append([key, n, 0])
                continue
            tail.append([key, n, 1])
            out.append(key)
            out_n.append(n)
            freed += n
            closed_main += 1
        # the moves, in the order the walk made them
        if tail:
            pop = main.pop
            for key, n, state in tail:
                if state != 2:
                    pop(key, None)
                    main[key] = n
        self._main_bytes = main_bytes
        if order is None:
            small = self._small
            for key in graduated:
                del small[key]
            if small_moved:
                small.update([(k, small.pop(k)) for k in small_moved])
            self._small_bytes = small_bytes
        else:
            # Main's keys met at the front go behind small's, so the next walk does not meet them
            # again.  Small's keys the walk skipped go to its tail; the ones it chose too when it
            # fails (on success the level evicts them: where they stand no longer matters).
            moved = small_moved if freed < nbytes else skipped
            if moved and not order.settled():
                self._stale = True  # reservations are out: they commit behind these (``on_insert``)
            order.move_to_end(blockers + graduated + moved if blockers or graduated else moved)
        if freed < nbytes:
            return None
        ghost = self._ghost
        limit = self.capacity_bytes or (small_bytes + main_bytes)
        if ghost.keys().isdisjoint(out):
            # each victim to the ghost's end in order, then the ghost trimmed from the front once:
            # the same ghost as trimming after each one
            ghost.update(zip(out, out_n))
            self._ghost_bytes = _trim_front(ghost, self._ghost_bytes + sum(out_n), limit)
        else:  # a victim named before and not evicted is in the ghost already: one at a time
            for key, n in zip(out, out_n):
                ghost[key] = n
                self._ghost_bytes = _trim_front(ghost, self._ghost_bytes + n, limit)
        return out

    def __len__(self):
        if self._order is not None:
            return self._order.ready_count()
        return len(self._small) + len(self._main)

    def memory_bytes(self) -> int:
        return sum(sys.getsizeof(d) for d in (self._small, self._main, self._ghost, self._freq, self._size._d))

    def counters(self) -> dict[str, int]:
        order = self._order
        small_n = len(self._small) if order is None else order.ready_count() - len(self._main)
        small_b = self._small_bytes if order is None else order.ready_bytes() - self._main_bytes
        return {"tracked": len(self), "small": small_n, "small_bytes": small_b, "main": len(self._main),
                "main_bytes": self._main_bytes, "ghost": len(self._ghost), "ghost_bytes": self._ghost_bytes,
                "read_keys": len(self._freq), "follows_level_order": int(order is not None)}
