"""Every installed module runs on the oldest Python ``requires-python`` admits (3.10), read with ``ast``.

``tests/run.sh`` imports tierkv and runs the core store tests on the other Pythons (``tests/pyversions.sh``);
these checks run in the main suite, on any Python, and name the line that would break the floor:

1. every module parses as Python 3.10 (no ``except*``, no ``type`` statement, no ``def f[T]``);
2. no module uses a standard-library name newer than 3.10 (``enum.StrEnum``, ``typing.Self``, ``tomllib``,
   ``asyncio.TaskGroup``, ...) unless under ``if sys.version_info >= ...`` or in a ``try`` whose handler
   catches the ``ImportError`` / ``AttributeError`` of an older Python;
3. the range is said once: ``requires-python`` (3.10 to 3.13), ruff's ``target-version``, mypy's
   ``python_version``, the classifiers and the Pythons ``tests/pyversions.sh`` runs all agree.
"""

from __future__ import annotations

import ast
import os
import re

import pytest
from test_layers import ROOT, _pyproject, modules

FLOOR = (3, 10)

# the standard library's names newer than the floor: (module, name) -> the Python that brought it
NEWER: dict[tuple[str, str], tuple[int, int]] = {
    **{("enum", n): (3, 11) for n in ("StrEnum", "ReprEnum", "EnumType", "EnumCheck", "FlagBoundary", "verify",
                                      "member", "nonmember", "global_enum", "show_flag_values")},
    **{("typing", n): (3, 11) for n in ("Self", "Never", "assert_never", "LiteralString", "Required",
                                        "NotRequired", "reveal_type", "assert_type", "dataclass_transform",
                                        "TypeVarTuple", "Unpack", "get_overloads", "clear_overloads")},
    **{("typing", n): (3, 12) for n in ("override", "TypeAliasType")},
    **{("typing", n): (3, 13) for n in ("ReadOnly", "TypeIs", "NoDefault", "get_protocol_members", "is_protocol")},
    **{("asyncio", n): (3, 11) for n in ("TaskGroup", "timeout", "timeout_at", "Timeout", "Runner", "Barrier")},
    **{("asyncio", n): (3, 12) for n in ("eager_task_factory", "create_eager_task_factory")},
    ("asyncio", "QueueShutDown"): (3, 13),
    ("datetime", "UTC"): (3, 11),
    ("hashlib", "file_digest"): (3, 11),
    ("contextlib", "chdir"): (3, 11),
    ("operator", "call"): (3, 11),
    ("math", "cbrt"): (3, 11), ("math", "exp2"): (3, 11), ("math", "sumprod"): (3, 12), ("math", "fma"): (3, 13),
    ("sys", "exception"): (3, 11), ("sys", "monitoring"): (3, 12),
    ("logging", "getLevelNamesMapping"): (3, 11), ("logging", "getHandlerByName"): (3, 12),
    ("logging", "getHandlerNames"): (3, 12),
    ("inspect", "getmembers_static"): (3, 11), ("inspect", "markcoroutinefunction"): (3, 12),
    ("itertools", "batched"): (3, 12),
    ("threading", "setprofile_all_threads"): (3, 12), ("threading", "settrace_all_threads"): (3, 12),
    ("copy", "replace"): (3, 13),
    ("warnings", "deprecated"): (3, 13),
    ("queue", "ShutDown"): (3, 13),
}
NEWER_MODULES = {"tomllib": (3, 11), "wsgiref.types": (3, 11)}
NEWER_BUILTINS = {"ExceptionGroup": (3, 11), "BaseExceptionGroup": (3, 11), "PythonFinalizationError": (3, 13)}
# methods of builtin types: flagged wherever called (no library of ours defines these names)
NEWER_METHODS = {"add_note": (3, 11)}
_GUARDS = {"ImportError", "ModuleNotFoundError", "AttributeError", "NameError"}


def _is_version_check(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "version_info" for n in ast.walk(test))


def _guards(handler: ast.ExceptHandler) -> bool:
    names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
    return handler.type is None or any(isinstance(n, ast.Name) and n.id in _GUARDS for n in names)


def newer_than_floor(source: str, path: str = "<src>") -> list[str]:
    """Each use of a name newer than the floor outside a version guard, as ``path:line: name (3.N)``."""
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> module, from "import x" / "import x as y"

    def flag(node: ast.AST, what: str, since: tuple[int, int]) -> None:
        if since > FLOOR:
            found.append(f"{path}:{node.lineno}: {what} (Python {since[0]}.{since[1]})")

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and _is_version_check(node.test):
            for child in node.body + node.orelse:
                visit(child, True)
            return
        if isinstance(node, ast.Try) and any(_guards(h) for h in node.handlers):
            for child in node.body:
                visit(child, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if not guarded and a.name in NEWER_MODULES:
                    flag(node, f"import {a.name}", NEWER_MODULES[a.name])
        elif isinstance(node, ast.ImportFrom) and not node.level and not guarded:
            mod = node.module or ""
            if mod in NEWER_MODULES:
                flag(node, f"from {mod} import ...", NEWER_MODULES[mod])
            for a in node.names:
                if (mod, a.name) in NEWER:
                    flag(node, f"from {mod} import {a.name}", NEWER[(mod, a.name)])
        elif isinstance(node, ast.Attribute) and not guarded:
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                key = (aliases[node.value.id], node.attr)
                if key in NEWER:
                    flag(node, f"{key[0]}.{key[1]}", NEWER[key])
            if node.attr in NEWER_METHODS:
                flag(node, f".{node.attr}()", NEWER_METHODS[node.attr])
        elif isinstance(node, ast.Name) and not guarded and node.id in NEWER_BUILTINS:
            flag(node, node.id, NEWER_BUILTINS[node.id])
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(source, path), False)
    return found


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_every_module_parses_as_the_floor_python():
    bad = []
    for name, (path, _) in sorted(modules().items()):
        try:
            ast.parse(_read(path), path, feature_version=FLOOR)
        except SyntaxError as e:
            bad.append(f"{name}:{e.lineno}: {e.msg}")
    assert not bad, "syntax newer than Python 3.10:\n" + "\n".join(bad)


def test_no_module_uses_a_standard_library_name_newer_than_the_floor():
    bad = []
    for _name, (path, _) in sorted(modules().items()):
        bad += newer_than_floor(_read(path), os.path.relpath(path, ROOT))
    assert not bad, "standard-library names newer than Python 3.10:\n" + "\n".join(bad)


@pytest.mark.parametrize("source,flagged", [
    ("import enum\nclass A(enum.StrEnum): pass", ["enum.StrEnum (Python 3.11)"]),
    ("from enum import StrEnum", ["from enum import StrEnum (Python 3.11)"]),
    ("import typing as t\nx: t.Self", ["typing.Self (Python 3.11)"]),
    ("import tomllib", ["import tomllib (Python 3.11)"]),
    ("import datetime\ndatetime.UTC", ["datetime.UTC (Python 3.11)"]),
    ("raise ExceptionGroup('x', [])", ["ExceptionGroup (Python 3.11)"]),
    ("import itertools\nitertools.batched([], 2)", ["itertools.batched (Python 3.12)"]),
    # guarded: what an older Python is given instead
    ("try:\n    import tomllib\nexcept ModuleNotFoundError:\n    import tomli as tomllib", []),
    ("import sys, enum\nif sys.version_info >= (3, 11):\n    E = enum.StrEnum", []),
    # what 3.10 has
    ("import enum, typing\nclass A(str, enum.Enum): pass\nx: typing.Optional[int]", []),
])
def test_the_check_names_what_breaks_the_floor(source, flagged):
    assert [f.split(": ", 1)[1] for f in newer_than_floor(source)] == flagged


def _classified() -> list[str]:
    return sorted((c.rsplit(" :: ", 1)[1] for c in _pyproject()["project"].get("classifiers", [])
                   if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)), key=lambda v: int(v[2:]))


def _run_sh_versions() -> list[str]:
    text = _read(os.path.join(ROOT, "tests", "pyversions.sh"))
    m = re.search(r'^VERSIONS="\$\{TIERKV_PYVERSIONS:-([0-9. ]+)\}"', text, re.M)
    assert m, "tests/pyversions.sh names its Pythons in VERSIONS=\"${TIERKV_PYVERSIONS:-...}\""
    return m.group(1).split()


def test_the_floor_is_said_once_and_every_claimed_python_is_run():
    project = _pyproject()
    # the range admits exactly the Pythons CI runs: no upper bound would claim every Python to come
    assert project["project"]["requires-python"] == ">=3.10,<3.14"
    assert project["tool"]["ruff"]["target-version"] == "py310"
    assert project["tool"]["mypy"]["python_version"] == "3.10"
    classified = _classified()
    assert classified[0] == "3.10" and classified[-1] == "3.13", classified
    # the main suite runs on 3.11; tests/pyversions.sh on every other Python the classifiers claim
    assert sorted({*_run_sh_versions(), "3.11"}, key=lambda v: int(v[2:])) == classified


# -- one enum style: word-valued enums derive from tierkv.enums.StrEnum ---------------------------------------
def test_word_valued_enums_have_one_base():
    bad = []
    for name, (path, _) in sorted(modules().items()):
        if name == "tierkv.enums":
            continue
        for node in ast.walk(ast.parse(_read(path), path)):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if ("str" in bases and bases & {"enum.Enum", "Enum"}) or bases & {"enum.StrEnum"}:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: class {node.name}({', '.join(sorted(bases))})")
    assert not bad, "a word-valued enum not derived from tierkv.enums.StrEnum:\n" + "\n".join(bad)


def test_strenum_prints_compares_and_serialises_as_its_value():
    import enum
    import json

    from tierkv.enums import StrEnum

    class Mode(StrEnum):
        FAST = "fast"
        SAFE_MODE = enum.auto()

    assert Mode.SAFE_MODE.value == "safe_mode"  # auto() gives the lower-case name, as enum.StrEnum does
    m = Mode.FAST
    assert isinstance(m, str) and m == "fast" and Mode("fast") is m
    assert str(m) == f"{m}" == "%s" % m == "{}".format(m) == "fast"  # noqa: UP031, UP032 (each way of printing)
    assert f"{m:>6}|" == "  fast|"
    assert json.dumps({m: [m]}) == '{"fast": ["fast"]}'
    assert repr(m) == "<Mode.FAST: 'fast'>"
