"""The layers of the installed ``tierkv`` package, read from the source with ``ast`` (nothing is imported).

Layers, bottom to top:

* **core**: every installed module outside the two below — the foundations flat in ``tierkv/``, the store
  engine, the media (``tierkv.tiers``) and the policies (``tierkv.policies``);
* **adapters** (``tierkv.adapters``): the vLLM connector and the SGLang backend, over the core;
* **tools** (``tierkv.tools``, and ``tierkv.__main__`` behind ``python -m tierkv``): the operator's command,
  simulator, benchmarks, demos and inspection; they may import anything.

Rules checked here:

1. no core module imports ``tierkv.adapters`` or ``tierkv.tools``, at module level, inside a function or
   under ``if TYPE_CHECKING:`` (``tests/test_import_direction.py`` holds the finer layers and every direction);
2. no import cycle among tierkv modules through module-level imports (a cycle through ``if TYPE_CHECKING:``
   counts too: two modules that need each other's names are one module in two files);
3. no core module imports vLLM, and the ``tierkv`` command imports neither vLLM nor the adapter at module
   level (``tierkv --help`` starts without them);
4. every ``tierkv`` import, including the ones inside functions that only run on some path, names a module
   that exists and a name that module defines — what a file move leaves stale;
5. no module only re-exports another (a shim kept for an old import path);
6. every package on disk is in pyproject.toml's package list, so a non-editable ``pip install .`` ships it, and
   the console scripts name functions that exist.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest brings tomli
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Import:
    module: str  # the module named (absolute)
    name: str | None  # for "from module import name"
    line: int
    top: bool  # runs when the module is imported (not inside a function)
    type_only: bool  # under "if TYPE_CHECKING:"


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


@cache
def package_dirs() -> dict[str, str]:
    """Installed package name -> its folder, from pyproject.toml's ``package-dir``."""
    return dict(_pyproject()["tool"]["setuptools"]["package-dir"])


@cache
def modules() -> dict[str, tuple[str, bool]]:
    """Every installed tierkv module: name -> (path, is a package)."""
    mapped = package_dirs()
    out: dict[str, tuple[str, bool]] = {}
    for pkg, folder in mapped.items():
        top = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(top):
            rel = os.path.relpath(dirpath, top)
            name = pkg if rel == "." else f"{pkg}.{rel.replace(os.sep, '.')}"
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and f"{name}.{d}" not in mapped]
            if "__init__.py" not in filenames:
                dirnames[:] = []
                continue
            for f in filenames:
                if f.endswith(".py"):
                    out[name if f == "__init__.py" else f"{name}.{f[:-3]}"] = (os.path.join(dirpath, f), f == "__init__.py")
    return out


@cache
def tree(module: str) -> ast.Module:
    path = modules()[module][0]
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@cache
def imports(module: str) -> tuple[Import, ...]:
    """Every import statement of ``module``, with relative ones made absolute."""
    return imports_in(tree(module), module, modules()[module][1])


def imports_in(node: ast.Module, module: str, is_pkg: bool) -> tuple[Import, ...]:
    """Every import statement of ``node``, the source of ``module`` (a package's ``__init__`` when ``is_pkg``)."""
    found: list[Import] = []

    def walk(node: ast.AST, top: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, None, child.lineno, top, type_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = module.split(".")[:None if is_pkg else -1]
                    parts = parts[:len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                found.extend(Import(base, a.name, child.lineno, top, type_only) for a in child.names)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    walk(ast.Module(body=[stmt], type_ignores=[]), top, True)
                for stmt in child.orelse:
                    walk(ast.Module(body=[stmt], type_ignores=[]), top, type_only)
            else:
                inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                walk(child, top and not inner, type_only)

    walk(node, True, False)
    return tuple(found)


def targets(imp: Import) -> list[str]:
    """The tierkv modules an import loads: ``from pkg import sub`` loads ``pkg.sub``, other names ``pkg``."""
    mods = modules()
    if imp.name is not None and f"{imp.module}.{imp.name}" in mods:
        return [f"{imp.module}.{imp.name}"]
    return [imp.module] if imp.module in mods else []


def layer(module: str) -> str:
    if module == "tierkv.tools" or module.startswith("tierkv.tools.") or module == "tierkv.__main__":
        return "tools"
    if module == "tierkv.adapters" or module.startswith("tierkv.adapters."):
        return "adapters"
    return "core"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _where(module: str, imp: Import) -> str:
    return f"{os.path.relpath(modules()[module][0], ROOT)}:{imp.line}"


def test_the_module_table_is_read():
    """The reading below sees the whole house (a guard against checking nothing)."""
    mods = modules()
    for name in ("tierkv", "tierkv.store", "tierkv.tiers.ssd.tier", "tierkv.policies.eviction",
                 "tierkv.adapters.vllm.connector", "tierkv.tools.cli", "tierkv.tools.sim.replay"):
        assert name in mods, name
    assert {layer(m) for m in mods} == {"core", "adapters", "tools"}
    assert any(not i.top for i in imports("tierkv.tools.cli.demo")), "function-level imports are read"
    assert any(i.type_only for m in mods for i in imports(m)), "TYPE_CHECKING imports are read"


def test_core_imports_neither_adapters_nor_tools():
    bad = sorted({f"{_where(m, i)} {m} imports {i.module}" for m in modules() if layer(m) == "core"
                  for i in imports(m) for p in ("tierkv.adapters", "tierkv.tools") if _within(i.module, p)
                  or (i.name is not None and _within(f"{i.module}.{i.name}", p))})
    assert not bad, "a foundation or engine module imports an adapter or a tool:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def module_graph() -> dict[str, set[str]]:
    return {m: {t for i in imports(m) if i.top for t in targets(i) if t != m} for m in modules()}


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = module_graph()
    found = []
    for comp in _cycles(graph):
        members = set(comp)
        edges = {f"  {m} -> {t} ({_where(m, i)})": None for m in comp for i in imports(m) if i.top
                 for t in targets(i) if t in members and t != m}
        found.append(" <-> ".join(comp) + "\n" + "\n".join(edges))
    assert not found, "import cycles among tierkv modules:\n" + "\n".join(found)


def test_core_never_imports_vllm_and_the_command_loads_it_lazily():
    bad = sorted({f"{_where(m, i)} {m} imports {i.module}" for m in modules() if layer(m) == "core"
                  for i in imports(m) if _within(i.module, "vllm")})
    assert not bad, "the core imports vLLM:\n" + "\n".join(bad)
    # what `tierkv --help` loads: the command's modules and everything they import at module level
    seen, todo = set(), ["tierkv.tools.cli", "tierkv.__main__"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for i in imports(m):
            if i.top and not i.type_only:
                assert not _within(i.module, "vllm") and not any(_within(t, "tierkv.adapters") for t in targets(i)), (
                    f"{_where(m, i)}: the tierkv command imports {i.module} at module level")
                todo.extend(targets(i))


def test_the_command_starts_without_torch_vllm_or_the_adapter():
    code = ("import sys, tierkv.tools.cli; tierkv.tools.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'vllm', 'tierkv.adapters', 'tierkv.store') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _defined(module: str) -> tuple[set[str], bool]:
    """Top-level names ``module`` binds, and whether it may bind more (a star import, a module ``__getattr__``)."""
    names: set[str] = set()
    open_ended = False

    def bind(target: ast.AST) -> None:
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                names.add(n.id)

    def walk(body: list[ast.stmt]) -> None:
        nonlocal open_ended
        for s in body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(s.name)
                open_ended |= s.name == "__getattr__"
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (s.targets if isinstance(s, ast.Assign) else [s.target]):
                    bind(t)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                for a in s.names:
                    open_ended |= a.name == "*"
                    names.add(a.asname or a.name.split(".")[0])
            elif isinstance(s, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    walk(getattr(s, field, []) or [])
                for h in getattr(s, "handlers", []):
                    walk(h.body)

    walk(tree(module).body)
    return names, open_ended


def test_every_tierkv_import_names_what_exists():
    mods = modules()
    bad = []
    for m in mods:
        for i in imports(m):
            if not _within(i.module, "tierkv"):
                continue
            if i.module not in mods:
                bad.append(f"{_where(m, i)} {i.module}: no such module")
                continue
            if i.name is None or i.name == "*" or f"{i.module}.{i.name}" in mods:
                continue
            names, open_ended = _defined(i.module)
            if i.name not in names and not open_ended:
                bad.append(f"{_where(m, i)} {i.module} defines no {i.name!r}")
    assert not bad, "stale tierkv imports:\n" + "\n".join(bad)


def test_no_module_only_re_exports_another():
    shims = []
    for m, (path, is_pkg) in modules().items():
        body = tree(m).body
        if is_pkg or m == "tierkv.__main__" or not body:
            continue
        rest = [s for s in body if not (isinstance(s, (ast.Import, ast.ImportFrom))
                                         or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                                         or (isinstance(s, ast.Assign)
                                             and [getattr(t, "id", None) for t in s.targets] == ["__all__"]))]
        if not rest and any(isinstance(s, ast.ImportFrom) for s in body):
            shims.append(os.path.relpath(path, ROOT))
    assert not shims, "modules that only re-export another (import the real module instead):\n" + "\n".join(shims)


def test_every_package_is_installed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {m for m, (_, is_pkg) in modules().items() if is_pkg}
    assert on_disk - listed == set(), "packages a non-editable install would leave out (pyproject.toml packages)"
    assert listed - on_disk == set(), "pyproject.toml lists packages that do not exist"


def test_console_scripts_name_functions_that_exist():
    scripts = _pyproject()["project"]["scripts"]
    assert set(scripts) == {"tierkv", "tierkv-demo"}
    for command, spec in scripts.items():
        module, _, attr = spec.partition(":")
        assert module in modules() and attr in _defined(module)[0], f"{command} = {spec!r}: no such function"
