"""Laying callers' parts out as (pointer, size) lists a backend can move, staging what it cannot reach.

A backend moves bytes only from or into registered memory it can address
(``RemoteClient.accepts_device``).  Parts it can reach are registered by their
whole storage (``Session.pin``; released by the caller with ``Session.unpin``).
Parts it cannot reach (a device tensor over ``tcp``) are laid out in one
tier-owned host buffer, copied there before a put and out of it after a get.

A client may bring its own staging memory (``client.staging_memory``: a host
tensor, e.g. memory shared with another process, the only memory that client
can move); it is then used instead of a tier-owned buffer, and a batch must fit
in it (``max_batch_bytes``).

Ownership: the staging buffer belongs to the tier (or, when the client brought
it, to the client).  Calls that stage hold ``Staging.lock`` for their whole
duration (one staging buffer, one user); calls that do not stage run
concurrently.  A call abandoned at its deadline may still use the buffer, so
the tier then ``abandon()``s it: a tier-owned buffer is dropped and the next
call allocates a fresh one; a client's memory cannot be replaced, so the whole
session is retired (its client is closed once that call has finished) and the
next session brings fresh memory.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from ..base import Parts
from .session import Registration, Session

#: (object index, part index, offset in the staging buffer) of each staged part
Staged = list[tuple[int, int, int]]


class Staging:
    """The tier's host staging buffer and the layout of batches onto caller memory or it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buf: torch.Tensor | None = None

    @property
    def buffer(self) -> torch.Tensor:
        if self._buf is None:
            raise RuntimeError("no staging buffer: layout() did not stage anything")
        return self._buf

    def abandon(self, session: Session) -> None:
        """A call that staged was abandoned and may still use the buffer: never hand it out again."""
        if getattr(session.client, "staging_memory", None) is not None:
            session.retire()  # the client's own memory goes with its client
        self._buf = None

    @staticmethod
    def max_batch_bytes(session: Session) -> int | None:
        """The most bytes one backend call may stage (None: no limit)."""
        mem = getattr(session.client, "staging_memory", None)
        return None if mem is None else mem.numel()

    def batches(self, session: Session | None, todo: list[int], bufs: Sequence[Parts]) -> list[list[int]]:
        """``todo`` cut into batches that fit the client's staging memory (one batch when it has none)."""
        limit = None if session is None else self.max_batch_bytes(session)
        if limit is None:
            return [todo] if todo else []
        out: list[list[int]] = []
        cur: list[int] = []
        n = 0
        for i in todo:
            size = sum(p.numel() for p in bufs[i])
            if cur and n + size > limit:
                out.append(cur)
                cur, n = [], 0
            cur.append(i)  # an object larger than the limit goes alone, and is refused by the layout
            n += size
        if cur:
            out.append(cur)
        return out

    def _ensure(self, session: Session, nbytes: int) -> torch.Tensor | None:
        mem = getattr(session.client, "staging_memory", None)
        if mem is not None:
            self._buf = mem if nbytes <= mem.numel() else None
            return self._buf
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        return self._buf

    @contextlib.contextmanager
    def guard(self, session: Session, objs: Sequence[Parts]) -> Iterator[bool]:
        """For one call over ``objs``: the staging lock when some part must be staged, and the session held
        open (its client's memory may be in use).  Yields False when the session is retired: touch nothing."""
        with self.lock if self._stages(session, objs) else contextlib.nullcontext(), session.hold() as live:
            yield live

    @staticmethod
    def _stages(session: Session, objs: Sequence[Parts]) -> bool:
        accepts = session.client.accepts_device
        for parts in objs:
            types = {p.device.type for p in parts if p.numel()}
            if len(types) > 1 or not all(accepts(t) for t in types):
                return True
        return False

    def layout(self, session: Session, objs: Sequence[Parts], pins: list[Registration],
               staged: Staged) -> tuple[list[list[int]], list[list[int]]] | None:
        """(ptrs, sizes) per object, empty parts left out; registered storages are appended to ``pins``.

        Parts the backend cannot reach are laid out in the staging buffer and
        listed in ``staged``.  An object mixing devices is moved as host memory
        (one copy direction per object).  None when a registration fails or
        the staged bytes exceed the client's staging memory.
        """
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        rebase: list[tuple[int, int, int]] = []  # (object, slot in its ptr list, staging offset)
        off = 0
        client = session.client
        for i, parts in enumerate(objs):
            pl, sl = [], []
            mixed = len({p.device.type for p in parts if p.numel()}) > 1
            for j, p in enumerate(parts):
                n = p.numel()
                if n == 0:
                    continue
                if client.accepts_device(p.device.type) and not (mixed and p.device.type != "cpu"):
                    reg = session.pin(p)
                    if reg is None:
                        return None
                    pins.append(reg)
                    pl.append(p.data_ptr())
                else:
                    staged.append((i, j, off))
                    rebase.append((i, len(pl), off))
                    pl.append(0)
                    off += n
                sl.append(n)
            ptrs.append(pl)
            sizes.append(sl)
        if rebase:
            buf = self._ensure(session, off)
            if buf is None:
                return None  # more than the client's staging memory holds: refused, never overrun
            reg = session.pin(buf)
            if reg is None:
                return None
            pins.append(reg)
            for i, slot, soff in rebase:
                ptrs[i][slot] = buf.data_ptr() + soff
        return ptrs, sizes

    @staticmethod
    def devices(session: Session, objs: Sequence[Parts]) -> list[str]:
        """Per object, the device type its bytes move from/to ("cpu" when staged through host)."""
        out = []
        for parts in objs:
            types = {p.device.type for p in parts if p.numel()}
            dev = types.pop() if len(types) == 1 else "cpu"
            out.append(dev if session.client.accepts_device(dev) else "cpu")
        return out
