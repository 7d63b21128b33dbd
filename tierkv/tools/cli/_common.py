"""What the subcommands share: exit codes, errors, sizes, tables, progress, JSON output.

Output convention of every command: ``--json`` prints one JSON document to
stdout and nothing else (no table, no notes); warnings, notes and progress go to
stderr, with or without ``--json``.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A failure a command reports in one line; ``code`` is its exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_num(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str], out=None) -> None:
    """A plain aligned table: first column left, the others right."""
    out = out or sys.stdout
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        line = "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
        print(line.rstrip(), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def dump_json(obj: Any, path: Optional[str] = None) -> None:
    """``obj`` as one JSON document on stdout (the ``--json`` convention: nothing else goes there).

    ``path`` (other than None or ``-``): to that file instead, for a command not yet on the convention.
    """
    text = json.dumps(obj, indent=2, default=str, allow_nan=False)
    if path in (None, "-"):
        print(text)
        return
    with open_output(str(path), "--json") as f:
        f.write(text + "\n")


def note(command: str, text: str) -> None:
    """A warning or note for the operator: stderr, so that stdout stays the command's answer."""
    print(f"tierkv {command}: {text}", file=sys.stderr, flush=True)


def open_output(path: str, what: str, mode: str = "w"):
    """``open(path, mode)`` for an output option; a path that cannot be written is a one-line ``CommandError``."""
    try:
        return open(path, mode, encoding=None if "b" in mode else "utf-8")
    except OSError as e:
        raise CommandError(f"{what} {path}: cannot write: {e.strerror or e}") from e


class Progress:
    """Progress of a long run on stderr: a tqdm bar on a terminal, else a plain line every ``period`` seconds.

    ``update(n)`` counts ``n`` more units done.  Without a terminal nothing is printed for a run shorter
    than ``period``; a longer one prints a line each ``period`` — from a timer, so a single long step
    still shows it is alive — and a last one when it ends.
    """

    def __init__(self, total: Optional[int], desc: str, unit: str = "it", period: float = 5.0,
                 command: str = "") -> None:
        self.total, self.desc, self.unit, self.period = total, desc, unit, period
        self.prefix = f"tierkv {command}: " if command else "tierkv: "
        self.done = 0
        self._t0 = time.monotonic()
        self._printed = False
        self._bar = None
        self._stop = threading.Event()
        self._timer: Optional[threading.Thread] = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
        else:
            self._timer = threading.Thread(target=self._tick, name="tierkv-progress", daemon=True)
            self._timer.start()

    def update(self, n: int = 1) -> None:
        self.done += n  # (one writer: the run's thread; the timer only reads)
        if self._bar is not None:
            self._bar.update(n)

    def _tick(self) -> None:
        while not self._stop.wait(self.period):
            self._line(time.monotonic())

    def _line(self, now: float, end: str = "") -> None:
        of = f"/{self.total}" if self.total else ""
        print(f"{self.prefix}{self.desc}: {self.done}{of} {self.unit} in {now - self._t0:.0f} s{end}",
              file=sys.stderr, flush=True)
        self._printed = True

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._timer is not None:
            self._stop.set()
            self._timer.join()
            self._timer = None
            if self._printed:
                self._line(time.monotonic(), " (done)")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(total: Optional[int], desc: str, unit: str = "it", command: str = "") -> Progress:
    return Progress(total, desc, unit, command=command)


def positive(v: Optional[float], option: str, integer: bool = False) -> None:
    """A numeric option must be a finite number above 0 (when given)."""
    if v is None:
        return
    if not math.isfinite(v) or v <= 0:
        raise CommandError(f"{option} must be a positive {'integer' if integer else 'number'}, got {v!r}")


def parse_kv_sizes(items: Sequence[str], what: str) -> dict[str, int]:
    """``["dram=64GiB", ...]`` -> {"dram": bytes}."""
    from tierkv.units import parse_size

    out = {}
    for it in items or ():
        name, sep, val = it.partition("=")
        if not sep or not name:
            raise CommandError(f"{what} {it!r}: expected NAME=VALUE")
        out[name] = parse_size(val, f"{what} {name}")
    return out


def load_store_config(path: Optional[str]) -> Any:
    from tierkv.config import load_config

    if path is None:
        raise CommandError("--config is required (a store config: .json, .yaml, .yml or .toml)")
    return load_config(path)
