"""Whether a hit is worth loading: each tier's load time against the engine's compute time, measured live.

A hit is worth claiming only if loading it is faster than computing it.  Both sides
are measured from what the connector sees (:class:`Rate`): each tier's loads
(tokens, seconds, calls: ``seconds = latency + tokens * per_token``) and the
engine's steps of at least ``MIN_STEP_TOKENS`` tokens (tokens scheduled, seconds of
the step: the slope is the marginal time to compute one more token; with steps of
one size, their seconds per token).  Each new sample halves the weight of the older
ones of its rate (``decay``): a tier that slows down is seen at its next load, and a
tier's newest load, where it is faster than the fit, stands for the tier (one fast
load after a slow spell brings it back).

:meth:`Decliner.decide` walks a hit's blocks tier by tier, in order (a hit is a
prefix: declining a tier cuts it at that tier's first block).  A tier whose part of
the hit would load slower than ``bias`` times its compute time, by more than
``margin_s``, is declined, except
for a share ``probe_share`` of those hits (one in ``1 / probe_share``, paced, never
at random), claimed anyway so that its estimate stays fresh and a tier that
recovers is seen.  Without ``min_samples`` samples of a tier, or of the engine's
steps, nothing is declined.  :class:`DeclineBook` is the scheduler's side: it feeds
the rule the workers' stats and counts its verdicts.  Pure: no clock, no I/O, no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: samples a rate needs before it decides anything
MIN_SAMPLES = 3
#: a step's tokens below which it is not a compute sample (a decode step's time is mostly fixed costs)
MIN_STEP_TOKENS = 64
#: the weight an older sample keeps when a new one arrives
DECAY = 0.5
#: the seconds a hit's part must lose against computing it before it is declined: below this, the timings'
#: noise decides (a thread scheduled late on a busy machine, a tiny model that computes a block in a
#: millisecond), and a wrong decline recomputes what was there to load
MARGIN_S = 0.05
#: below this relative spread of the samples' sizes, a rate has no slope of its own: seconds / tokens
_FLAT = 0.05


class Rate:
    """``seconds = latency + units * per_unit``, fitted by least squares over exponentially decayed samples."""

    __slots__ = ("_w", "_x", "_xx", "_xy", "_y", "decay", "last", "samples")

    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        #: samples seen (undecayed)
        self.samples = 0
        #: the newest sample: (units, seconds) per call
        self.last = (0.0, 0.0)
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, units: float, seconds: float, calls: int = 1) -> None:
        """One sample: ``calls`` calls moved ``units`` in ``seconds`` together."""
        if units <= 0 or seconds < 0 or calls <= 0:
            return
        d = self.decay
        x, y, w = units / calls, seconds / calls, float(calls)
        self._w = self._w * d + w
        self._x = self._x * d + w * x
        self._y = self._y * d + w * y
        self._xx = self._xx * d + w * x * x
        self._xy = self._xy * d + w * x * y
        self.samples += 1
        self.last = (x, y)

    def fit(self) -> tuple[float, float]:
        """``(latency, per_unit)`` in seconds; ``(0, 0)`` without samples."""
        if self._w <= 0 or self._x <= 0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > (_FLAT * mx) ** 2:
            slope = (self._xy / self._w - mx * my) / var
            latency = my - slope * mx
            if slope > 0 and latency >= 0:
                return latency, slope
        return 0.0, my / mx

    def seconds(self, units: float) -> float:
        latency, per_unit = self.fit()
        return latency + units * per_unit

    def per_unit(self) -> float:
        return self.fit()[1]


@dataclass(frozen=True)
class Verdict:
    """What to claim of a hit: its first ``blocks`` blocks; ``declined`` the tier that cut it (None: whole hit),
    ``probed`` the tiers claimed though slow (a probe each)."""

    blocks: int
    declined: str | None = None
    probed: tuple[str, ...] = ()
    #: the tokens cut by the decline
    declined_tokens: int = 0


@dataclass
class Decliner:
    """Load time per tier against compute time, and the hits that lose (see the module's doc)."""

    bias: float = 1.0
    probe_share: float = 1.0 / 16
    margin_s: float = MARGIN_S
    min_samples: int = MIN_SAMPLES
    decay: float = DECAY
    tiers: dict[str, Rate] = field(default_factory=dict)
    compute: Rate = field(default_factory=Rate)
    _credit: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bias <= 0:
            raise ValueError(f"bias must be above 0, got {self.bias}")
        if not 0.0 <= self.probe_share <= 1.0:
            raise ValueError(f"probe_share must be in [0, 1], got {self.probe_share}")
        if not self.margin_s >= 0:
            raise ValueError(f"margin_s must be 0 or more, got {self.margin_s}")
        self.compute = Rate(max(self.decay, 0.9))  # (steps come many a second: a longer memory)

    def observe_load(self, tier: str, tokens: float, seconds: float, calls: int = 1) -> None:
        rate = self.tiers.get(tier)
        if rate is None:
            rate = self.tiers[tier] = Rate(self.decay)
        rate.add(tokens, seconds, calls)

    def observe_step(self, tokens: float, seconds: float, steps: int = 1) -> None:
        """``steps`` engine steps computed ``tokens`` in ``seconds``; steps of under ``MIN_STEP_TOKENS`` tokens
        each (decodes) say little about a prefill's rate and are left out."""
        if tokens >= MIN_STEP_TOKENS * steps:
            self.compute.add(tokens, seconds, steps)

    def load_seconds(self, tier: str, tokens: float) -> float | None:
        """The time ``tokens`` of ``tier`` would take to load (None: too few samples): the fit over the decayed
        samples, or the newest sample's rate where that is faster (a tier that recovered is claimed again after
        one fast load)."""
        rate = self.tiers.get(tier)
        if rate is None or rate.samples < self.min_samples:
            return None
        fit = rate.seconds(tokens)
        x, y = rate.last
        at_last = rate.seconds(x)
        return fit * min(1.0, y / at_last) if at_last > 0 else fit

    def compute_seconds(self, tokens: float) -> float | None:
        """The time the engine would take to compute ``tokens`` (None: too few samples)."""
        if self.compute.samples < self.min_samples:
            return None
        return self.compute.per_unit() * tokens

    def slow(self, tier: str, tokens: float) -> bool:
        """Whether ``tokens`` of ``tier`` load slower than ``bias`` times their compute, by more than ``margin_s``
        (False without evidence)."""
        load = self.load_seconds(tier, tokens)
        compute = self.compute_seconds(tokens)
        return load is not None and compute is not None and load > self.bias * compute + self.margin_s

    def _probe(self, tier: str) -> bool:
        """Whether this slow hit of ``tier`` is claimed anyway (one in ``1 / probe_share``, paced)."""
        if self.probe_share <= 0.0:
            return False
        credit = self._credit.get(tier, 0.0) + self.probe_share
        if credit + 1e-12 >= 1.0:
            self._credit[tier] = credit - 1.0
            return True
        self._credit[tier] = credit
        return False

    def decide(self, tiers: Sequence[str | None], block_tokens: int) -> Verdict:
        """How much of a hit of ``len(tiers)`` blocks (``block_tokens`` each, served from ``tiers[i]``; None:
        unknown, always claimed) to claim."""
        probed: list[str] = []

        def declines(tier: str, tokens: int) -> bool:
            if not self.slow(tier, tokens):
                return False
            if self._probe(tier):
                probed.append(tier)
                return False
            return True

        v = cut(tiers, block_tokens, declines)
        return Verdict(v.blocks, v.declined, tuple(probed), v.declined_tokens)


def cut(tiers: Sequence[str | None], block_tokens: int, declines: Callable[[str, int], bool]) -> Verdict:
    """The rule's walk over a hit: each tier in the order the hit reaches it, with its tokens in the hit;
    the first tier ``declines(tier, tokens)`` says is slow cuts the hit at its first block (``tierkv simulate``
    asks it with fixed bandwidths and a fixed prefill rate)."""
    tokens: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, t in enumerate(tiers):
        if t is not None:
            tokens[t] = tokens.get(t, 0) + block_tokens
            first.setdefault(t, i)
    for t, i in first.items():
        if declines(t, tokens[t]):
            return Verdict(i, t, (), (len(tiers) - i) * block_tokens)
    return Verdict(len(tiers))


#: the counters a verdict adds to, by tier (the connector's stats and the scheduler's totals)
COUNTERS = ("declined_slow", "declined_slow_tokens", "decline_probes")


class DeclineBook:
    """The scheduler's side of the rule: fed the workers' step and load timings (their stats payload), it
    judges each hit and counts the verdicts: in ``totals`` (since the start) and the interval's counts (for
    the connector's stats), by tier."""

    def __init__(self, decliner: Decliner, totals: dict[str, dict[str, int]] | None = None) -> None:
        self.decliner = decliner
        #: each of COUNTERS -> counts by tier (``totals``: the caller's dicts, counted into)
        self.totals = totals if totals is not None else {k: {} for k in COUNTERS}
        self._interval: dict[str, dict[str, int]] = {}

    def observe(self, data: Any) -> None:
        """A step's stats payload from the workers: ``steps``, ``step_tokens``, ``step_s`` and ``tier_loads``
        (tier -> [tokens, seconds, load jobs])."""
        data = getattr(data, "data", data)
        if not isinstance(data, dict):
            return
        if data.get("steps"):
            self.decliner.observe_step(data.get("step_tokens", 0), data.get("step_s", 0.0), data["steps"])
        for tier, (tokens, seconds, jobs) in (data.get("tier_loads") or {}).items():
            self.decliner.observe_load(tier, tokens, seconds, jobs)

    def count(self, v: Verdict) -> None:
        """Count a verdict (once per admitted request)."""
        counts = [("decline_probes", t, 1) for t in v.probed]
        if v.declined is not None:
            counts += [("declined_slow", v.declined, 1), ("declined_slow_tokens", v.declined, v.declined_tokens)]
        for key, tier, n in counts:
            for book in (self.totals[key], self._interval.setdefault(key, {})):
                book[tier] = book.get(tier, 0) + n

    def take(self) -> dict[str, dict[str, int]]:
        """The counts since the last call."""
        out, self._interval = self._interval, {}
        return out
