"""The ssd engine's components, each built on its own: the shared state, the write path, the read path,
reclamation and checkpoints, without ``SSDTier``; and the shape that keeps them followable (no mixins, no
forward declarations, no name shared with the store's modules)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from tier_conformance import blob, key

from tierkv.tiers.base import Tier
from tierkv.tiers.ssd import SSDTier
from tierkv.tiers.ssd import region as R
from tierkv.tiers.ssd.checkpointer import Checkpointer
from tierkv.tiers.ssd.counters import SSDCounters
from tierkv.tiers.ssd.health import Health
from tierkv.tiers.ssd.reclaim import Reclaimer
from tierkv.tiers.ssd.recordreader import RecordReader
from tierkv.tiers.ssd.regionchange import RegionChanger
from tierkv.tiers.ssd.regionio import RegionIO
from tierkv.tiers.ssd.segmentwriter import SegmentWriter
from tierkv.tiers.ssd.state import EngineState

MiB = 1 << 20
ROOT = pathlib.Path(__file__).resolve().parent.parent
SSD = ROOT / "tiers" / "ssd"


def build(path: pathlib.Path, capacity: int = 8 * MiB) -> tuple:
    """The engine's components over a new directory, wired as ``SSDTier`` wires them (no open: nothing there)."""
    st = EngineState("ssd", "tier 'ssd' (ssd)", str(path), capacity, MiB, None, "xxh3", "flush")
    cfg = st.config
    cfg.ensure_dirs()
    st.catalogue.open_dead()
    owners = (cfg, st.table, st.catalogue, st.locks, st.counters)
    health = Health(cfg.what, cfg.path, st.counters, st.locks.lock)
    io = RegionIO(cfg, st.table, health)
    checkpointer = Checkpointer(*owners, health, io)
    checkpointer.note_dir()
    reclaimer = Reclaimer(*owners, health, io)
    changer = RegionChanger(*owners, health, io, reclaimer, checkpointer)
    return (st, io, checkpointer, reclaimer, changer, SegmentWriter(*owners, health, io, changer, checkpointer),
            RecordReader(*owners, health, 2))


def test_a_writer_and_a_reader_built_alone_round_trip_and_a_tier_reopens_what_they_wrote(tmp_path):
    st, io, checkpointer, _, _, writer, reader = build(tmp_path / "s")
    # one batch through each way a payload travels buffered: copied into the image (small), written from the
    # caller's parts (4 KiB and more), several parts, an empty payload
    keys = [key(i) for i in range(40)]
    vals = [[blob(i, (100, 5000, 100_000)[i % 3])] for i in range(39)] + [[blob(1, 3000), blob(2, 7000)]]
    vals[7] = [torch.zeros(0, dtype=torch.uint8)]
    assert writer.write(keys, vals) == [True] * 40
    outs = [[torch.empty(sum(p.numel() for p in v), dtype=torch.uint8)] for v in vals]
    assert reader.read(keys, outs) == [True] * 40
    assert all(torch.equal(o[0], torch.cat(v)) for o, v in zip(outs, vals))
    assert len(st.catalogue.index) == 40 and st.table.live_total > 0 and st.counters.io_errors == 0
    checkpointer.checkpoint()  # (flush and a checkpoint: what a reopen reads)
    reader.shutdown()
    io.shutdown()
    io.close_fds()
    t = SSDTier("ssd", 8 * MiB, str(tmp_path / "s"))
    assert t.extra_stats()["recovered_from"] == "checkpoint"
    assert sorted(k for k, _ in t.recover()) == sorted(keys)
    t.close()


def test_the_reclaimer_picks_the_emptiest_sealed_region_and_the_oldest_among_equals(tmp_path):
    st, _, _, reclaimer, _, _, reader = build(tmp_path / "s")
    reader.shutdown()
    regions = {}
    for idx, (state, live, seq) in enumerate([(R.SEALED, 500, 9), (R.SEALED, 300, 7), (R.SEALED, 300, 4),
                                              (R.ACTIVE, 0, 10), (R.FREE, 0, 2)]):
        r = R.Region(idx, str(tmp_path / f"r{idx}"))
        r.state, r.live_bytes, r.seq = state, live, seq
        regions[idx] = r
    for r in regions.values():
        st.table.add(r)
    assert reclaimer.pick_victim() is regions[2]  # 300 live bytes, seq 4 older than seq 7
    regions[2].foreign = True  # (a file not ours is never reclaimed)
    assert reclaimer.pick_victim() is regions[1]
    # moving a victim must leave room for the largest object (``max_slot``)
    assert reclaimer.worth_reclaiming(regions[1])
    full = R.Region(99, str(tmp_path / "full"))
    full.live_bytes = st.config.usable - st.config.max_slot + 1
    assert not reclaimer.worth_reclaiming(full)


def _classes(path: pathlib.Path) -> list[ast.ClassDef]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]


def test_the_engine_is_composed_not_assembled():
    """No ``if TYPE_CHECKING:`` stand-ins, no class of the engine built from several others, and
    ``SSDTier`` a ``Tier`` holding its components."""
    for path in sorted(SSD.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If):
                assert "TYPE_CHECKING" not in ast.unparse(node.test), f"{path.name}:{node.lineno}"
        for cls in _classes(path):
            assert len(cls.bases) <= 1, f"{path.name}: class {cls.name} has bases {[ast.unparse(b) for b in cls.bases]}"
    assert SSDTier.__bases__ == (Tier,)


def test_no_class_or_module_of_the_engine_shares_a_name_with_the_rest_of_the_project():
    ssd_classes = {c.name for p in SSD.glob("*.py") for c in _classes(p)}
    ssd_modules = {p.stem for p in SSD.glob("*.py")} - {"__init__"}
    for root in ("tierkv", "tiers", "policies", "adapters"):
        for path in (ROOT / root).rglob("*.py"):
            if path.parent == SSD:
                continue
            assert path.stem not in ssd_modules, f"{path.relative_to(ROOT)} repeats a module name of tiers/ssd"
            clash = ssd_classes & {c.name for c in _classes(path)}
            assert not clash, f"{path.relative_to(ROOT)} defines {clash}, as tiers/ssd does"


def test_the_counters_are_typed_and_exported_under_their_names(tmp_path):
    """One attribute per counter (``SSDCounters``); ``extra_stats`` exports each under its name, and no
    module of the engine names a counter by a string (``counters["..."]``)."""
    t = SSDTier("ssd", 8 * MiB, str(tmp_path / "s"), region_size="1MiB")
    try:
        assert t.write([key(1)], [[blob(1, 3000)]]) == [True]
        stats = t.extra_stats()
        assert set(SSDCounters.names()) <= set(stats)
        assert {n: stats[n] for n in SSDCounters.names()} == t._state.counters.as_dict()
        with pytest.raises(AttributeError):
            t._state.counters.no_such_counter = 1  # (slots: a misspelt counter fails, never counts apart)
    finally:
        t.close()
    for path in sorted(SSD.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and "counters" in ast.unparse(node.value):
                raise AssertionError(f"{path.name}:{node.lineno}: a counter named by a subscript")


def test_the_configuration_is_fixed_once_the_tier_is_open(tmp_path):
    t = SSDTier("ssd", 8 * MiB, str(tmp_path / "s"), region_size="1MiB")
    try:
        cfg = t._state.config
        assert cfg.region_size == MiB and cfg.regions_needed() == t.regions_needed()
        with pytest.raises(AttributeError):
            cfg.region_size = 2 * MiB
        with pytest.raises(AttributeError):
            cfg.adopt_region_size(2 * MiB)
        assert cfg.region_size == MiB and cfg.geometry().region_size == MiB
    finally:
        t.close()


def test_the_region_table_and_the_catalogue_keep_live_bytes_and_the_dead_log_together(tmp_path):
    """What the owners promise: ``live_total`` is the regions' live bytes summed, whatever writes, replacements,
    removals and region changes did; a retired record is named in the dead log."""
    t = SSDTier("ssd", 8 * MiB, str(tmp_path / "s"), region_size="1MiB")
    try:
        table, cat = t._state.table, t._state.catalogue
        for rnd in range(3):  # (replacements, and enough bytes for several regions)
            assert t.write([key(i) for i in range(60)], [[blob(i + rnd, 40_000)] for i in range(60)]) == [True] * 60
        t.delete([key(i) for i in range(0, 60, 3)])
        with t._state.locks.lock:
            assert table.live_total == sum(r.live_bytes for r in table.regions.values()) > 0
            assert sum(r.live_count for r in table.regions.values()) == len(cat.index) == 40
            assert len(cat.dead.pending) + cat.dead.size() > 0 and cat.changed
        with pytest.raises(AttributeError):
            table.live_total = 0  # type: ignore[misc]  (changed through the table's methods only)
        with pytest.raises(AttributeError):
            cat.changed = False  # type: ignore[misc]
    finally:
        t.close()


def _chain(node: ast.AST) -> list[str]:
    """The attribute names ``node`` (an attribute or subscript) reaches through: ``a._cat.index.x[i]`` -> ``[x,
    index, _cat]``."""
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    return names


def test_no_component_assigns_the_owners_fields():
    """The components change the region table, the catalogue and the configuration through their methods:
    no assignment to an attribute of them or into one (``self._cat.index.digest[...] = ...``), and a
    region's live counts change in ``regiontable.py`` alone."""
    owners = {"_table", "_cat", "_cfg", "_locks"}
    for path in sorted(SSD.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Attribute, ast.Subscript)) or not isinstance(node.ctx, ast.Store):
                continue
            chain = _chain(node)
            assert not owners & set(chain[1:] if isinstance(node, ast.Attribute) else chain), (
                f"{path.name}:{node.lineno}: assigns {ast.unparse(node)}")
            if chain and chain[0] in ("live_bytes", "live_count", "live_total", "_live_total"):
                assert path.name in ("regiontable.py", "region.py"), f"{path.name}:{node.lineno}: {ast.unparse(node)}"
