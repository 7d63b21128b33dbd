"""Which way imports may point inside the installed ``tierkv`` package, read from the source with ``ast``.

Layers, lowest first; a module may import its own layer and the layers below it, never one above:

0. **contracts**: the vocabulary every layer shares, flat in ``tierkv/``: ``errors``, ``enums``, ``units``,
   ``options``, ``outcome``, ``keys``, ``persist``, ``stats``, ``durability``, ``location_code`` (``CONTRACTS``);
1. **foundations**: mechanisms the media and the core share, flat in ``tierkv/``: ``buffers``, ``checksum``,
   ``xxh3``, ``hostmem``, ``shutdown``, ``weights`` (``FOUNDATIONS``);
2. **media and policies**: ``tierkv.tiers`` (``tiers/``) and ``tierkv.policies`` (``policies/``): they implement
   the ``Tier`` and policy interfaces over the two layers below and know nothing of the store;
3. **core**: the ``tierkv`` package itself, every other module flat in ``tierkv/`` (the store, its config, the
   metrics catalogue and exporter, the trace writer, the shadow caches, ...) and the store engine
   (``tierkv.engine``): the store composes media and policies, so it sits above them;
4. **adapters** (``tierkv.adapters``, ``adapters/``): the vLLM connector and the SGLang backend;
5. **tools** (``tierkv.tools`` and ``tierkv.__main__``): the ``tierkv`` command, simulator, benchmarks, demos,
   live and offline inspection; nothing imports them.

``tierkv.tiers``, ``tierkv.policies`` and ``tierkv.adapters`` are mapped onto ``tiers/``, ``policies/`` and
``adapters/`` by pyproject.toml's ``package-dir``; the reading here (``test_layers.modules``) follows that map.

What counts as an arrow (every one is held to the direction):

* every ``import`` / ``from ... import``, at module level or inside a function (a lazy import is an import that
  happens later);
* imports under ``if TYPE_CHECKING:`` too: no exception is made for typing, a lower layer that needs a higher
  layer's type names what it reads as a ``Protocol`` (``tierkv.persist.Medium``);
* a ``"tierkv.package.module:Name"`` string constant: the registries that build parts from a config
  (``tierkv.tiers.MEDIA``, ``tierkv.tiers.remote.backends.BACKENDS``) resolve such strings on first use, so a
  string is an import by another name and may not point up either.  The store reaches the media it builds
  from a config by a direct import of ``tierkv.tiers`` (core above media); the media table in turn names only
  media modules.

Package cycles: no two packages may import each other, through any import (lazy and ``TYPE_CHECKING`` ones
included; registry strings excluded: a registry naming the modules of its own package is how it lists its
members).  The unit is the installed package, except that the modules flat in ``tierkv/`` count as the
package of their layer (contracts, foundations, core), the store engine belongs to the core's package (the
engine uses ``tierkv.hooks`` and ``tierkv.tenants``, the store uses the engine), and the tools are one
package (the command dispatches to the tools, the demos print through the command's helpers).

``test_a_wrong_way_import_is_reported`` and ``test_a_package_cycle_is_reported`` feed the checks synthetic
sources, so a check that reports nothing has been shown able to report.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from test_layers import ROOT, Import, _cycles, imports_in, modules, targets, tree

LAYERS = ("contracts", "foundations", "media and policies", "core", "adapters", "tools")
RANK = {name: i for i, name in enumerate(LAYERS)}

#: flat modules of ``tierkv/`` in the contracts layer (depend on contracts only)
CONTRACTS = frozenset({"errors", "enums", "units", "options", "outcome", "keys", "persist", "stats", "durability",
                       "location_code"})
#: flat modules of ``tierkv/`` in the foundations layer (depend on contracts and foundations only)
FOUNDATIONS = frozenset({"buffers", "checksum", "xxh3", "hostmem", "shutdown", "weights"})

REGISTRY_STRING = re.compile(r"tierkv(\.\w+)+:\w+")


def layer(module: str) -> str:
    """The layer of a ``tierkv`` module, from its name."""
    parts = module.split(".")
    if parts[0] != "tierkv":
        raise ValueError(f"{module} is no tierkv module")
    sub = parts[1] if len(parts) > 1 else None
    if sub in ("tools", "__main__"):
        return "tools"
    if sub == "adapters":
        return "adapters"
    if sub in ("tiers", "policies"):
        return "media and policies"
    if sub in CONTRACTS and len(parts) == 2:
        return "contracts"
    if sub in FOUNDATIONS and len(parts) == 2:
        return "foundations"
    return "core"


def unit(module: str) -> str:
    """The package a module counts in for the cycle check (see the module docstring)."""
    lay = layer(module)
    if lay in ("contracts", "foundations", "core", "tools"):
        return f"tierkv[{lay}]"
    mods = modules()
    if module in mods and mods[module][1]:
        return module  # a package's __init__
    return module.rsplit(".", 1)[0]


@dataclass(frozen=True)
class Arrow:
    source: str  # the importing module
    target: str  # the tierkv module it loads (or names in a registry string)
    where: str  # path:line
    how: str  # "import", "lazy import", "TYPE_CHECKING import", "registry string"

    def __str__(self) -> str:
        return (f"{self.where}: {self.source} ({layer(self.source)}) -> {self.target} ({layer(self.target)}), "
                f"{self.how}")


def _how(imp: Import) -> str:
    if imp.type_only:
        return "TYPE_CHECKING import"
    return "import" if imp.top else "lazy import"


def arrows_in(module: str, is_pkg: bool, node: ast.Module, path: str) -> list[Arrow]:
    """Every arrow from ``module``, whose source is ``node``: its imports of tierkv modules and its registry
    strings."""
    out = [Arrow(module, t, f"{path}:{imp.line}", _how(imp))
           for imp in imports_in(node, module, is_pkg) for t in targets(imp) if t != module]
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and REGISTRY_STRING.fullmatch(n.value):
            target = n.value.partition(":")[0]
            if target != module:
                out.append(Arrow(module, target, f"{path}:{n.lineno}", "registry string"))
    return out


def all_arrows() -> list[Arrow]:
    return [a for m, (path, is_pkg) in modules().items()
            for a in arrows_in(m, is_pkg, tree(m), os.path.relpath(path, ROOT))]


def wrong_way(arrows: Iterable[Arrow], layer_of: Callable[[str], str] = layer) -> list[str]:
    """The arrows that point from a layer to one above it."""
    return sorted({str(a) for a in arrows if RANK[layer_of(a.target)] > RANK[layer_of(a.source)]})


def package_cycles(arrows: Iterable[Arrow], unit_of: Callable[[str], str] = unit) -> list[str]:
    """Each set of packages that import each other, with the arrows that close the loop."""
    arrows = [a for a in arrows if a.how != "registry string"]
    graph: dict[str, set[str]] = {}
    for a in arrows:
        s, t = unit_of(a.source), unit_of(a.target)
        graph.setdefault(s, set())
        graph.setdefault(t, set())
        if s != t:
            graph[s].add(t)
    found = []
    for comp in _cycles(graph):
        members = set(comp)
        closing = sorted({f"  {a}" for a in arrows
                          if unit_of(a.source) in members and unit_of(a.target) in members
                          and unit_of(a.source) != unit_of(a.target)})
        found.append(" <-> ".join(comp) + "\n" + "\n".join(closing))
    return found


# -- the checks ----------------------------------------------------------------------------------------------
def test_every_layer_is_populated_and_the_listed_modules_exist():
    """A guard against checking nothing: every layer holds modules, the lists name real modules, and the
    reading sees lazy imports, TYPE_CHECKING imports and registry strings."""
    mods = modules()
    by_layer: dict[str, set[str]] = {name: set() for name in LAYERS}
    for m in mods:
        by_layer[layer(m)].add(m)
    assert all(by_layer.values()), {k: len(v) for k, v in by_layer.items()}
    for name in CONTRACTS | FOUNDATIONS:
        assert f"tierkv.{name}" in mods, f"tierkv.{name} is listed in a layer and does not exist"
    assert layer("tierkv.engine.level") == "core" and layer("tierkv.tiers.ssd.tier") == "media and policies"
    assert layer("tierkv.adapters.vllm.prom") == "adapters" and layer("tierkv.__main__") == "tools"
    hows = {a.how for a in all_arrows()}
    assert hows == {"import", "lazy import", "TYPE_CHECKING import", "registry string"}, hows


def test_no_import_points_up():
    bad = wrong_way(all_arrows())
    assert not bad, ("imports against the layers (contracts <- foundations <- media and policies <- core <- "
                     "adapters <- tools):\n" + "\n".join(bad))


def test_no_package_cycle():
    found = package_cycles(all_arrows())
    assert not found, "packages that import each other:\n" + "\n".join(found)


def test_the_library_the_adapters_use_is_in_the_core():
    """The metrics catalogue, its exporter and the trace writer are core modules: no adapter reaches a tool."""
    for name in ("tierkv.metrics", "tierkv.trace", "tierkv.shadow", "tierkv.config_observers"):
        assert name in modules() and layer(name) == "core", name
    used = {a.target for a in all_arrows() if layer(a.source) == "adapters"}
    assert {"tierkv.metrics", "tierkv.trace"} <= used, sorted(used)


#: what the store engine never imports, though it is in its own layer: the observers a config attaches (above
#: the engine, by ``tierkv.config_observers``) and what reads the store from outside
ABOVE_THE_ENGINE = frozenset({"tierkv.config_observers", "tierkv.shadow", "tierkv.trace", "tierkv.metrics",
                              "tierkv.store", "tierkv.stores"})


def engine_reaches_up(arrows: Iterable[Arrow]) -> list[str]:
    """The arrows from the store engine (``tierkv.engine``) to a core module that sits above it."""
    return sorted({str(a) for a in arrows if a.source.startswith("tierkv.engine.") and a.target in ABOVE_THE_ENGINE})


def test_the_engine_imports_no_observer_and_not_the_store():
    """The store engine attaches no observer by itself: the tracer and the shadow are attached above it."""
    bad = engine_reaches_up(all_arrows())
    assert not bad, "\n".join(bad)


# -- the checks can fail ---------------------------------------------------------------------------------------
def _synthetic(module: str, source: str, is_pkg: bool = False) -> list[Arrow]:
    return arrows_in(module, is_pkg, ast.parse(source), f"<{module}>")


def test_a_wrong_way_import_is_reported():
    cases = {
        # a contract importing a medium, lazily
        ("tierkv.persist", "def default(m):\n    from tierkv.tiers.base import Tier\n"): "tierkv.tiers.base",
        # an adapter importing a tool, relative import
        ("tierkv.adapters.vllm.prom", "from ...tools import live\n"): "tierkv.tools.live",
        # a contract importing a foundation, for typing only
        ("tierkv.outcome", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from tierkv.buffers import Parts\n"): "tierkv.buffers",
        # a medium importing the store
        ("tierkv.tiers.dram", "import tierkv.store\n"): "tierkv.store",
        # a policy registry naming a tool by string
        ("tierkv.policies.registry", "TABLE = {'x': 'tierkv.tools.inspect:main'}\n"): "tierkv.tools.inspect",
        # a foundation importing the package face (which loads the store)
        ("tierkv.buffers", "from tierkv import TieredStore\n"): "tierkv",
    }
    for (module, source), target in cases.items():
        found = wrong_way(_synthetic(module, source))
        assert len(found) == 1 and f"{module} " in found[0] and f"-> {target} " in found[0], (module, found)
    # the right way round is no finding
    assert wrong_way(_synthetic("tierkv.tools.demo_vllm", "from tierkv.adapters.sglang import options\n")) == []
    assert wrong_way(_synthetic("tierkv.store", "from tierkv.tiers import medium_class\n")) == []
    assert wrong_way(_synthetic("tierkv.tiers.ssd.tier", "from tierkv.errors import ConfigError\n")) == []
    # the engine reaching the shadow, even for typing only
    lazy = _synthetic("tierkv.engine.observers", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from tierkv.shadow import ShadowObserver\n")
    found = engine_reaches_up(lazy)
    assert len(found) == 1 and "-> tierkv.shadow (core), TYPE_CHECKING import" in found[0], found
    assert engine_reaches_up(_synthetic("tierkv.config_observers", "from tierkv.shadow import attach\n")) == []


def test_a_package_cycle_is_reported():
    arrows = [*_synthetic("tierkv.tiers.ssd.tier", "from tierkv.tiers.remote import pool\n"),
              *_synthetic("tierkv.tiers.remote.pool", "def f():\n    from tierkv.tiers.ssd import tier\n")]
    found = package_cycles(arrows)
    assert len(found) == 1 and found[0].startswith("tierkv.tiers.remote <-> tierkv.tiers.ssd"), found
    # a registry naming its own members is no cycle
    listing = [*_synthetic("tierkv.tiers", "MEDIA = {'ssd': 'tierkv.tiers.ssd:SSDTier'}\n", is_pkg=True),
               *_synthetic("tierkv.tiers.ssd.tier", "from tierkv.tiers.base import Tier\n")]
    assert package_cycles(listing) == []
