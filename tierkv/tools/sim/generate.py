"""Synthetic workloads with the reuse patterns of real serving, as traces.

Each prompt is a list of *segments* (a shared system prompt, a document, a
turn of a conversation, a tool's output); a segment is a run of blocks with a
content id.  A block's hash id is a function of its parent's hash id and its
content, so equal prefixes get equal ids and a change anywhere changes every
id after it — the property real block hashes have.

Kinds:

``chat``           multi-turn chats: each turn resends the history plus a new message
``system-prompt``  many short questions behind a few shared system prompts (Zipf popularity)
``rag``            templates plus retrieved documents (a Zipf-popular corpus) plus a question
``agent``          agent loops: a long shared tool manifest, then steps that append tool calls and results
``mix``            all of the above, interleaved
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator

from tierkv.errors import ConfigError

from .traces import Request

KINDS = ("chat", "system-prompt", "rag", "agent", "mix")


class _Hasher:
    """Chained ids: (parent id, content) -> a small int, the same for the same prefix."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def blocks(self, segments: list[tuple[object, int]]) -> list[int]:
        out, parent = [], -1
        for content, n in segments:
            for j in range(n):
                key = (parent, (content, j))
                h = self._ids.get(key)
                if h is None:
                    h = self._ids[key] = len(self._ids)
                out.append(h)
                parent = h
        return out


def _zipf_index(rng: random.Random, n: int, s: float = 1.1) -> int:
    """An index in [0, n) with Zipf(s)-like popularity (rank 0 the most popular)."""
    weights = _zipf_index.cache.get((n, s))  # type: ignore[attr-defined]  # (a cache kept on the function)
    if weights is None:
        weights = list(itertools.accumulate(1 / (k + 1) ** s for k in range(n)))
        _zipf_index.cache[(n, s)] = weights  # type: ignore[attr-defined]
    return min(n - 1, bisect.bisect_left(weights, rng.random() * weights[-1]))


_zipf_index.cache = {}  # type: ignore[attr-defined]


def generate(kind: str, requests: int = 1000, block_tokens: int = 512, seed: int = 0,
             rate: float = 2.0) -> Iterator[Request]:
    """``requests`` requests of workload ``kind``, arriving as a Poisson process of ``rate`` per second."""
    if kind not in KINDS:
        raise ConfigError(f"unknown workload {kind!r}; known: {', '.join(KINDS)}")
    if requests < 1 or block_tokens < 1:
        raise ConfigError("requests and block_tokens must be positive")
    rng = random.Random(seed)
    hasher = _Hasher()
    gens = {"chat": _chat, "system-prompt": _system_prompt, "rag": _rag, "agent": _agent}
    if kind == "mix":
        streams = [g(rng, hasher) for g in gens.values()]
        def pick():
            return rng.choice(streams)
    else:
        stream = gens[kind](rng, hasher)
        def pick():
            return stream
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        segments, out_len, session = next(pick())
        ids = hasher.blocks(segments)
        # the last block is partial: real prompts rarely end on a block boundary
        input_length = max(1, len(ids) * block_tokens - rng.randrange(block_tokens))
        yield Request(t, input_length, out_len, ids, block_tokens, session)


def _unique(rng: random.Random) -> tuple:
    return ("u", rng.getrandbits(48))


def _chat(rng: random.Random, hasher: _Hasher):
    """Sessions of 1-12 turns; ~30 open at once; each turn = system + history + new message."""
    system = [("chat-system", 2)]
    open_sessions: list[dict] = []
    next_id = 0
    while True:
        if len(open_sessions) < 30 or rng.random() < 0.1:
            open_sessions.append({"id": f"chat-{next_id}", "history": [], "turns": rng.randint(1, 12)})
            next_id += 1
        s = rng.choice(open_sessions)
        s["history"].append((_unique(rng), rng.randint(1, 3)))  # the user's message
        segments = system + s["history"]
        out = rng.randint(64, 512)
        s["history"].append((_unique(rng), 1))  # the assistant's answer joins the next prompt
        s["turns"] -= 1
        if s["turns"] <= 0:
            open_sessions.remove(s)
        yield segments, out, s["id"]


def _system_prompt(rng: random.Random, hasher: _Hasher):
    """A few long system prompts (Zipf), each followed by a one-off question."""
    while True:
        k = _zipf_index(rng, 8)
        yield [(("sys", k), 4 + 2 * k), (_unique(rng), rng.randint(1, 2))], rng.randint(32, 256), None


def _rag(rng: random.Random, hasher: _Hasher):
    """One of 4 templates, 3-5 documents of 2-6 blocks from a 2000-document corpus (Zipf), a question."""
    sizes = [2 + (d * 7919) % 5 for d in range(2000)]
    while True:
        segs: list[tuple[object, int]] = [(("template", rng.randrange(4)), 1)]
        docs = sorted({_zipf_index(rng, 2000, 0.9) for _ in range(rng.randint(3, 5))})
        segs += [(("doc", d), sizes[d]) for d in docs]
        segs.append((_unique(rng), 1))
        yield segs, rng.randint(64, 256), None


def _agent(rng: random.Random, hasher: _Hasher):
    """Agents with a 12-block shared tool manifest; each step appends a tool call and its result."""
    manifest = [("tools", 12)]
    agents: list[dict] = []
    next_id = 0
    while True:
        if len(agents) < 8:
            agents.append({"id": f"agent-{next_id}", "steps": [(_unique(rng), 1)], "left": rng.randint(5, 40)})
            next_id += 1
        a = rng.choice(agents)
        yield manifest + a["steps"], rng.randint(16, 128), a["id"]
        a["steps"].append((_unique(rng), rng.randint(1, 2)))  # the call it made and the tool's answer
        a["left"] -= 1
        if a["left"] <= 0:
            agents.remove(a)
