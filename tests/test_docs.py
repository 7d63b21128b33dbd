"""The documentation as a reference: pages short enough to read, table cells short enough to scan, and no link
or page name that leads nowhere.

What is checked (``doc_problems``), over README.md, CHANGELOG.md, every ``docs/*.md`` and every tracked ``.py``:

* every ``docs/*.md`` page and README.md has at most ``MAX_LINES`` lines (``PAGE_LIMITS`` names the exceptions);
* no markdown table cell is longer than ``MAX_CELL`` characters (long explanations go in prose under the table);
* every relative markdown link ``[text](path)`` and ``[text](path#anchor)`` names a file that exists, and its
  anchor (or a bare ``(#anchor)``) is the GitHub slug of a heading of the page it names;
* every mention of a page as ``docs/<page>.md`` (in prose, docstrings and messages) names a file that exists, and
  when a section is named right after it in quotes (``docs/vllm-audits.md, "Tolerance"``, ``docs/ssd.md ("Figures")``),
  a heading of that page starts with the quoted words.

Fenced code blocks are not markdown: their lines are neither tables nor links (``docs/<page>.md`` mentions in
them are still checked).  The checker's own failures are tested on a synthetic bad page, so a checker that
finds nothing cannot pass for one that checks.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the longest a docs page (or README.md) may be, in lines
MAX_LINES = 400
#: pages held to another limit, each with its reason: architecture.md carries the one-line-per-module listing of
#: the whole tree (95 lines), which grows with every module; it is the next candidate to move to a page of its own
PAGE_LIMITS: dict[str, int] = {}
#: the longest a markdown table cell may be, in characters (trimmed of the spaces around it)
MAX_CELL = 160

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
PAGE = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)(?:(?:,\s*|\s+\(|\s+)\"([^\"\n]+)\")?")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation other than ``-`` and ``_``
    removed, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line outside fenced code blocks."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line))
    return out


def headings(text: str) -> list[str]:
    """The text of every ATX heading outside code blocks, markup left in."""
    return [m.group(1).strip() for _, line in prose_lines(text) if (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line))]


def anchors(text: str) -> set[str]:
    """Every anchor a page's headings give, duplicates numbered as GitHub numbers them (``x``, ``x-1``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def table_cells(line: str) -> list[str]:
    """The cells of one table row (``|`` escaped as ``\\|`` stays in its cell)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def doc_problems(root: Path, pages: list[Path], others: list[Path]) -> list[str]:
    """Every breach of the rules above, one line each.  ``pages`` are the markdown files held to the length and
    table rules and whose links are followed; ``others`` are files only searched for ``docs/<page>.md`` mentions
    (their markdown links are followed too when they end in ``.md``)."""
    problems: list[str] = []
    texts: dict[Path, str] = {}

    def text_of(path: Path) -> str | None:
        path = path.resolve()
        if path not in texts:
            texts[path] = path.read_text(encoding="utf-8") if path.is_file() else None  # type: ignore[assignment]
        return texts[path]

    def where(path: Path, no: int) -> str:
        return f"{path.relative_to(root)}:{no}"

    for path in pages + others:
        text = text_of(path)
        assert text is not None, path
        is_md = path.suffix == ".md"
        if path in pages:
            n = len(text.splitlines())
            limit = PAGE_LIMITS.get(path.relative_to(root).as_posix(), MAX_LINES)
            if n > limit:
                problems.append(f"{path.relative_to(root)}: {n} lines, more than {limit}")
        if is_md:
            for no, line in prose_lines(text):
                if path in pages and line.lstrip().startswith("|"):
                    for cell in table_cells(line):
                        if len(cell) > MAX_CELL:
                            problems.append(f"{where(path, no)}: a table cell of {len(cell)} characters "
                                            f"(more than {MAX_CELL}): {cell[:60]}...")
                for m in LINK.finditer(line):
                    target = m.group(1)
                    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                        continue
                    file_part, _, anchor = target.partition("#")
                    dest = (path.parent / file_part) if file_part else path
                    if file_part and not dest.exists():
                        problems.append(f"{where(path, no)}: link to {target}: no such file")
                        continue
                    if anchor and dest.suffix == ".md" and anchor not in anchors(text_of(dest) or ""):
                        problems.append(f"{where(path, no)}: link to {target}: no heading with that anchor")
        for no, line in enumerate(text.splitlines(), 1):
            for m in PAGE.finditer(line):
                name, section = m.group(1), m.group(2)
                page = text_of(root / "docs" / name)
                if page is None:
                    problems.append(f"{where(path, no)}: names docs/{name}: no such file")
                elif section and not any(slug(h).startswith(slug(section)) for h in headings(page)):
                    problems.append(f"{where(path, no)}: names docs/{name}, \"{section}\": no such heading there")
    return problems


def repo_files() -> tuple[list[Path], list[Path]]:
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    others = [ROOT / "CHANGELOG.md"] + [ROOT / p for p in tracked if (ROOT / p).is_file()]
    return pages, others


def test_the_docs_keep_to_the_rules():
    pages, others = repo_files()
    assert len(pages) > 5 and any(p.name == "vllm.md" for p in pages)
    assert any(p.name == "connector.py" for p in others)
    problems = doc_problems(ROOT, pages, others)
    assert not problems, "\n".join(problems)


def test_every_vllm_connector_option_is_in_the_options_table():
    """docs/vllm.md's options table names exactly the options the connector accepts."""
    from tierkv.adapters.vllm.config import OPTION_NAMES

    text = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    table = text[text.index("## Options"):].split("\n## ", 1)[0]
    rows = [line for _, line in prose_lines(table) if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", table_cells(row)[0])}
    assert documented == set(OPTION_NAMES)


def test_slugs_follow_github():
    assert slug("Leases: a hit stays a hit (`lease_timeout_s`)") == "leases-a-hit-stays-a-hit-lease_timeout_s"
    assert slug("Prefill/decode disaggregation") == "prefilldecode-disaggregation"
    assert slug("What is verified, and where") == "what-is-verified-and-where"
    assert slug("See [the pool](pool.md) now") == "see-the-pool-now"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_the_checker_finds_every_kind_of_breach(tmp_path):
    D = "docs/"  # (spelt apart, so that this file names no missing page itself)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.md").write_text("# Good\n\n## Two words\n\ntext\n")
    long_cell = "x" * (MAX_CELL + 1)
    bad = docs / "bad.md"
    bad.write_text("\n".join([
        "# Bad",
        "| a | b |",
        "| --- | --- |",
        f"| `opt` | {long_cell} |",
        "[gone](missing.md) and [wrong anchor](good.md#three-words) and [here](#nowhere)",
        "[fine](good.md#two-words), [also fine](#bad), [web](https://example.com/x.md)",
        f"see {D}absent.md, and {D}good.md (\"Two words\") and {D}good.md, \"No such part\"",
        "```",
        "| in code | " + long_cell + " |",
        "[in code](nothing.md)",
        "```",
    ] + ["filler"] * MAX_LINES) + "\n")
    code = tmp_path / "mod.py"
    code.write_text(f'"""Options: see {D}vllm-gone.md."""\n')
    found = doc_problems(tmp_path, [docs / "good.md", bad], [code])
    assert any("bad.md:" in p and f"more than {MAX_LINES}" in p for p in found)
    assert any("bad.md:4:" in p and "table cell" in p for p in found)
    assert any("missing.md: no such file" in p for p in found)
    assert any("good.md#three-words: no heading" in p for p in found)
    assert any("#nowhere: no heading" in p for p in found)
    assert any(f"{D}absent.md: no such file" in p for p in found)
    assert any("\"No such part\": no such heading" in p for p in found)
    assert any(f"mod.py:1: names {D}vllm-gone.md" in p for p in found)
    assert len(found) == 8, found  # nothing else: code blocks, good links and the web link pass
    assert not doc_problems(tmp_path, [docs / "good.md"], [])
