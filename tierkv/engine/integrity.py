"""Integrity strategies: how one level keeps each chunk's checksum and checks what it reads.

A medium declares what it does (``Tier.keeps_bytes``, ``verifies_reads``, ``sum_inside``,
``sums_copies``: ``tiers/base.py``, "Checksums"); a level is configured with a ``verify``
option.  ``select`` reconciles the two, once, when the level is built, and nowhere else:
the level holds the answer as ``Level.integrity``, one of four strategies.

=================  ==========================================================================
``Unchecked``      a medium that keeps no bytes, or a level whose sums would serve nothing;
                   keeps no sum and checks nothing
``LevelSums``      the level keeps each chunk's sum beside it and checks reads against it
                   when configured to (``checks_reads``)
``Trailers``       a shared pool: each object carries its sum in a trailer after its bytes,
                   checked on every read
``MediumVerified`` a medium that checks its own records on every read (the ``ssd`` tier):
                   trusted, and a copy out of it is summed from the bytes it verified
=================  ==========================================================================

The invariant every strategy keeps with ``TierIO`` (``tierio.py``, which calls it for each
read and write): a read the engine answers True hands out the bytes stored, as far as the
level can tell (a checked level: exactly; an unchecked one: what its medium answered), and
a copy found wrong is a miss, never bytes.  A sum handed on to another level (a copy's
``sums_out``) is one the chunk was stored with, or one computed from bytes a check just
vouched for, never from bytes nobody verified.

Ownership: a strategy belongs to one level.  ``LevelSums`` owns that level's sums (``sums``,
a column beside the index, changed only under the store's lock by ``recorded`` and
``forget``); ``Trailers`` owns its trailer memory.  The strategies never call the medium and
never count or log: they say which copies fail, and ``TierIO`` drops, counts and logs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, Optional

from tierkv.buffers import Parts
from tierkv.checksum import ReadSums, TrailerArena, Verify, chunk_sum, chunk_sums, read_trailers
from tierkv.errors import ConfigError
from tierkv.tiers.base import Locality, Tier

Sums = list[Optional[int]]

_NO_SUMS: Mapping[str, int] = MappingProxyType({})


class Checked(NamedTuple):
    """A strategy's verdict on a read: the positions whose copy failed its check (to be dropped as corrupt),
    and each chunk's sum as a copy of it would carry it (None where none is known)."""

    bad: list[int]
    sums: Sums


class Framed(NamedTuple):
    """The objects a pooled call moves (each chunk's parts, and its trailer where the strategy frames them),
    what the call asks the medium to sum as it copies (None: nothing), and the strategy's note for ``*_done``."""

    objs: list[Parts]
    asked: Optional[ReadSums]
    note: Any


def mismatched(parts: Sequence[Parts], sums: Sequence[Optional[int]]) -> list[int]:
    """Positions whose bytes disagree with the sum given for them (a None sum is not checked)."""
    return [i for i, s in enumerate(sums) if s is not None and chunk_sum(parts[i]) != s]


class Integrity:
    """What a level does about checksums (see the module docstring); the base answers as a level that keeps no
    sum, frames nothing and finds no copy wrong."""

    #: the name stats and tests know it by
    kind: ClassVar[str] = ""
    #: the level keeps each chunk's sum beside it (``sums``)
    keeps_sums: ClassVar[bool] = False
    #: a write must be handed every chunk's sum (computed from the bytes where none travelled with it)
    needs_sums: ClassVar[bool] = False
    #: the engine checks every read of this level (``check_read`` may name bad copies)
    checks_reads: bool = False
    #: a checked read may ask the medium to sum what it copies (``Tier.sums_copies``)
    medium_sums: bool = False

    def __init__(self, tier: Tier) -> None:
        self.tier_name = tier.name

    @property
    def sums(self) -> Mapping[str, int]:
        """key -> the sum the level keeps of each chunk it holds (read-only; empty where it keeps none)."""
        return _NO_SUMS

    # -- writes ------------------------------------------------------------------------
    def sums_for_write(self, parts: Sequence[Parts], sums: Optional[Sums]) -> Optional[Sums]:
        """The sums a write goes with: ``sums`` as given, and, where this strategy ``needs_sums``, each
        missing one computed from the bytes (a chunk whose source kept none)."""
        if not self.needs_sums or (sums is not None and None not in sums):
            return sums
        return [chunk_sum(p) if sums is None or sums[i] is None else sums[i] for i, p in enumerate(parts)]

    def vets_copy_from(self, source: Integrity) -> bool:
        """A copy read from a level with ``source`` must be checked against its sums before it is written here
        (its read was not checked, and nothing here would catch a wrong byte later)."""
        return False

    def frame_write(self, parts: list[Parts], sums: Optional[Sums]) -> Framed:
        """The objects a write stores for these chunks (the chunks themselves, unless framed)."""
        return Framed(parts, None, None)

    def write_done(self, note: Any) -> None:
        """A framed write returned (``note``: ``frame_write``'s)."""

    def recorded(self, keys: list[str], sums: Optional[Sums], oks: list[bool]) -> None:
        """The chunks written (``oks``), with the sums they went with.  Lock held."""

    def forget(self, keys: list[str]) -> None:
        """The level freed these chunks: their sums go with them.  Lock held."""

    def kept(self, keys: list[str]) -> Sums:
        """The sum the level keeps of each chunk (None where it keeps none).  Lock held."""
        return [None] * len(keys)

    # -- reads ------------------------------------------------------------------------
    def check_read(self, keys: list[str], parts: list[Parts], oks: list, got: Optional[Sums]) -> Checked:
        """The verdict on a managed level's read: ``oks`` its answers, ``got`` the sums of the bytes read
        where already hashed (None, or None at a position: hashed here when needed)."""
        return Checked([], [None] * len(keys))

    def frame_read(self, parts: list[Parts]) -> Framed:
        """The objects a pooled read fills for these chunks (the chunks themselves, unless framed)."""
        return Framed(parts, None, None)

    def check_pooled(self, parts: list[Parts], res: list, framed: Framed) -> Checked:
        """The verdict on a pooled read (``res``: the medium's answers; ``framed``: ``frame_read``'s)."""
        return Checked([], [None] * len(parts))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tier_name!r})"


class Unchecked(Integrity):
    """No sum kept, no read checked: a medium that keeps no bytes (the simulator's), a shared pool that carries
    no trailers, or a level whose sums would serve neither a check nor a copy (``select``'s ``alone``).

    Guarantees nothing beyond the medium's own answer: a read returns what the medium answered True for, and
    a copy out of it carries no sum (the level below computes one from the bytes if it needs one)."""

    kind = "unchecked"


class LevelSums(Integrity):
    """The level keeps each chunk's sum beside it (``sums``), as the chunk was stored.

    Guarantees: a chunk written here keeps the sum it travelled with until it is freed; with
    ``checks_reads``, a read whose bytes disagree with that sum is a miss, never bytes; a copy out of it
    carries the kept sum, so the level below checks it again or keeps it as it was first computed."""

    kind = "level_sums"
    keeps_sums = True
    needs_sums = True

    def __init__(self, tier: Tier, checks: bool) -> None:
        super().__init__(tier)
        self.checks_reads = checks
        self.medium_sums = checks and tier.sums_copies
        self._sums: dict[str, int] = {}

    @property
    def sums(self) -> Mapping[str, int]:
        return MappingProxyType(self._sums)

    def recorded(self, keys: list[str], sums: Optional[Sums], oks: list[bool]) -> None:
        if sums is None:
            return
        if False in oks:
            self._sums.update([(k, s) for k, s, ok in zip(keys, sums, oks) if ok])  # type: ignore[misc]
        else:
            self._sums.update(zip(keys, sums))  # type: ignore[arg-type]

    def forget(self, keys: list[str]) -> None:
        if self._sums:
            pop = self._sums.pop
            for key in keys:
                pop(key, None)

    def kept(self, keys: list[str]) -> Sums:
        return list(map(self._sums.get, keys))

    def check_read(self, keys: list[str], parts: list[Parts], oks: list, got: Optional[Sums]) -> Checked:
        have = self.kept(keys)
        bad: list[int] = []
        if self.checks_reads:
            for i, ok in enumerate(oks):
                s = have[i]
                if ok and s is not None and (chunk_sum(parts[i]) if got is None or got[i] is None
                                             else got[i]) != s:
                    bad.append(i)
        return Checked(bad, have)


class Trailers(Integrity):
    """A shared pool: each object is the chunk's bytes then a trailer holding its sum (``tierkv.checksum``).

    Guarantees: every object written carries the sum its chunk travelled with; every read is checked, the
    trailer against the bytes (summed by the medium as it copied them where it can, by the store otherwise),
    and a copy whose trailer is unreadable or disagrees is a miss, never bytes; a copy out of it carries the
    trailer's sum.  The trailer memory (``TrailerArena``, per thread) is this strategy's: after a call the
    medium abandoned at its deadline (it may still touch that memory) it is let go."""

    kind = "trailers"
    needs_sums = True
    checks_reads = True

    def __init__(self, tier: Tier) -> None:
        super().__init__(tier)
        self._tier = tier
        self.medium_sums = tier.sums_copies
        self._arena = TrailerArena()

    def _abandoned(self) -> int:
        """How many calls the medium has abandoned at their deadline so far (0 for media without deadlines)."""
        return getattr(self._tier, "abandoned_calls", 0)

    def frame_write(self, parts: list[Parts], sums: Optional[Sums]) -> Framed:
        if sums is None:
            raise ValueError(f"tier {self.tier_name!r}: a pooled write needs each chunk's sum")
        before = self._abandoned()
        tr = self._arena.packed(sums, _device_of(parts))  # type: ignore[arg-type]
        return Framed([[*p, t] for p, t in zip(parts, tr)], None, before)

    def write_done(self, note: Any) -> None:
        if self._abandoned() != note:
            self._arena.drop()  # (an abandoned call may still read them)

    def frame_read(self, parts: list[Parts]) -> Framed:
        before = self._abandoned()
        tr = self._arena.views(len(parts), _device_of(parts))
        asked = ReadSums([sum([p.numel() for p in ps]) for ps in parts]) if self.medium_sums else None
        return Framed([[*p, t] for p, t in zip(parts, tr)], asked, (before, tr))

    def check_pooled(self, parts: list[Parts], res: list, framed: Framed) -> Checked:
        before, tr = framed.note
        if self._abandoned() != before:
            # a call abandoned meanwhile may still write into the trailers: read these, then let them go
            self._arena.drop()
        n = len(parts)
        got = [i for i, ok in enumerate(res) if ok is True]
        have: Sums = framed.asked.sums if framed.asked is not None else [None] * n
        left = [i for i in got if have[i] is None]  # what the medium did not sum: summed here
        for i, h in zip(left, chunk_sums([parts[i] for i in left])):
            have[i] = h
        stored = read_trailers(tr)
        sums: Sums = [None] * n
        bad: list[int] = []
        for i in got:
            s = stored[i]
            if s is None or have[i] != s:
                bad.append(i)
            else:
                sums[i] = s
        return Checked(bad, sums)


class MediumVerified(Integrity):
    """A medium that stores each object's sum with it and checks it on every read (``Tier.verifies_reads``,
    the same value as ``chunk_sum``): trusted, the level keeps no sum of its own.

    Guarantees: a read the medium answers True is the stored bytes (the medium's own check; a copy it finds
    wrong it answers ``CORRUPT``); a copy out of it carries the sum of the bytes just verified; a copy written
    into it from a level that keeps sums but did not check its read is checked against them first, so the
    medium never takes (and then vouches for) bytes that were already wrong."""

    kind = "medium_verified"

    def vets_copy_from(self, source: Integrity) -> bool:
        return source.keeps_sums and not source.checks_reads

    def check_read(self, keys: list[str], parts: list[Parts], oks: list, got: Optional[Sums]) -> Checked:
        return Checked([], [chunk_sum(p) if ok else None for p, ok in zip(parts, oks)])


def select(tier: Tier, managed: bool, verify: Verify, alone: bool = False) -> Integrity:
    """The one strategy for a level over ``tier`` (``managed``: the store accounts for its space; ``verify``:
    the level's option), the only place the medium's declarations and the level's config are reconciled.

    ``alone``: the level is a chain's only one, so no copy is ever made out of it: sums it would keep for no
    check serve nothing, and are not kept."""
    if not tier.keeps_bytes:
        return Unchecked(tier)
    if tier.sum_inside:
        if managed:
            raise ConfigError(f"tier {tier.name!r} ({tier.medium}): a medium that carries sums inside its "
                              "objects must manage its own space (managed = False)")
        return Trailers(tier)
    if tier.verifies_reads:
        return MediumVerified(tier)
    if not managed:
        return Unchecked(tier)
    checks = verify is Verify.ALWAYS or tier.locality in (Locality.REMOTE, Locality.DISK)
    if alone and not checks:
        return Unchecked(tier)
    return LevelSums(tier, checks)


def _device_of(objs: list[Parts]) -> Any:
    """The device of the first part of the first object (trailers go beside the chunk's bytes)."""
    for parts in objs:
        for p in parts:
            return p.device
    return None
