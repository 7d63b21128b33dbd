"""What the subcommands share: exit codes, errors, sizes, tables, progress bars, JSON output."""

from __future__ import annotations

import json
import sys
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
    """To ``path``, or to stdout when ``path`` is None or ``-``."""
    text = json.dumps(obj, indent=2, default=str)
    if path in (None, "-"):
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def progress(total: Optional[int], desc: str, unit: str = "it"):
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False,
                dynamic_ncols=True)


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
