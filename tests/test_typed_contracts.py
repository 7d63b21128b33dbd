"""Typed contracts of the config layer: enums for persist mode, locality and load mode, one spelling per
concept (a removed spelling is refused naming the one to use), admission answers in a store, and policy
modules that import without a cycle."""

from __future__ import annotations

import ast
import enum
import json
from pathlib import Path

import pytest
import torch

from tierkv import ConfigError, TieredStore
from tierkv.adapters.vllm.load_mode import LoadMode
from tierkv.engine.level import Level
from tierkv.options import check_enum
from tierkv.persist import PERSIST_MODES, PersistMode
from tierkv.policies import Admission, AllOf, FrequencyAdmission, RateLimitAdmission
from tierkv.tiers.base import Locality, Tier
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.null import NullTier
from tierkv.tiers.slab import ALIGN

C = 4 * ALIGN
ROOT = Path(__file__).resolve().parent.parent


def val(i: int) -> torch.Tensor:
    return torch.full((C,), i % 251, dtype=torch.uint8)


# -- the enums: members named, values the documented spellings --------------------------------------------
@pytest.mark.parametrize("kind,values", [
    (PersistMode, ["write_behind", "write_through", "on_evict"]),
    (Locality, ["device", "host", "remote", "disk"]),
    (LoadMode, ["sync", "async"]),
    (Admission, ["admit", "reject", "throttled"]),
])
def test_enums_hold_the_documented_spellings(kind, values):
    assert issubclass(kind, enum.Enum)
    assert [m.value for m in kind] == values
    for v in values:
        assert kind(v).value == v


def test_string_enums_print_and_serialise_as_their_spelling():
    assert PERSIST_MODES == ("write_behind", "write_through", "on_evict")
    for member in (PersistMode.WRITE_THROUGH, Locality.DISK, LoadMode.ASYNC):
        assert str(member) == f"{member}" == member.value
        assert json.dumps({"x": member}) == json.dumps({"x": member.value})


def test_check_enum_takes_a_member_or_its_spelling_and_names_the_option():
    assert check_enum("on_evict", "opt", PersistMode) is PersistMode.ON_EVICT
    assert check_enum(PersistMode.ON_EVICT, "opt", PersistMode) is PersistMode.ON_EVICT
    for bad in ("ON_EVICT", "on-evict", True, None, 3):
        with pytest.raises(ConfigError, match="tier 'x' option 'persist': expected one of"):
            check_enum(bad, "tier 'x' option 'persist'", PersistMode)


def test_a_level_s_persist_mode_is_a_persist_mode(tmp_path):
    store = TieredStore.from_config({"tiers": [
        {"medium": "dram", "capacity": "1MiB"},
        {"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "4MiB", "persist": "write_through"},
        {"medium": "ssd", "name": "s2", "path": str(tmp_path / "s2"), "capacity": "4MiB"},
    ]})
    try:
        modes = [info["persist"] for info in store.tier_info()]
        assert modes == [PersistMode.ON_EVICT, PersistMode.WRITE_THROUGH, PersistMode.WRITE_BEHIND]
        assert all(type(m) is PersistMode for m in modes)
        assert [info["locality"] for info in store.tier_info()] == [Locality.HOST, Locality.DISK, Locality.DISK]
        assert json.loads(json.dumps(store.tier_info()))[1]["persist"] == "write_through"
    finally:
        store.close()


def test_every_built_in_medium_declares_a_locality_member():
    from tierkv.tiers import medium_class
    from tierkv.tiers.hbm import HBMTier
    from tierkv.tiers.ssd import SSDTier

    assert HBMTier.locality is Locality.DEVICE and SSDTier.locality is Locality.DISK
    assert DRAMTier.locality is Locality.HOST
    assert medium_class("dram_pool").locality is Locality.REMOTE
    assert NullTier("n", 100, locality="disk").locality is Locality.DISK


def test_a_medium_class_declaring_a_string_locality_has_it_checked():
    class Mine(Tier):
        locality = "remote"  # type: ignore[assignment]

    assert Mine.locality is Locality.REMOTE
    with pytest.raises(ConfigError, match="medium class Typo: locality must be one of"):
        class Typo(Tier):
            locality = "hosts"  # type: ignore[assignment]


# -- removed spellings, through a store config --------------------------------------------------------------
@pytest.mark.parametrize("tier,top,match", [
    ({"eviction": "s3-fifo"}, {}, "'s3-fifo' is no longer a name: use 's3fifo'"),
    ({}, {"promotion": "on_hit"}, "'on_hit' is no longer a name: use 'on-hit'"),
    ({}, {"promotion": {"policy": "on_hit", "min_hits": 2}}, "use 'on-hit'"),
    ({"admission": {"policy": "frequency", "threshold": 2}}, {}, "'threshold' is no longer accepted: use "
                                                                 "'min_accesses'"),
    ({"write_through": True}, {}, "'write_through' is no longer accepted: use \"persist\": \"write_through\""),
    ({"write_through": False, "persist": "on_evict"}, {}, "use \"persist\""),
])
def test_a_config_with_a_removed_spelling_is_refused_naming_the_one_to_use(tier, top, match):
    with pytest.raises(ConfigError, match=match):
        TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB", **tier}], **top})


def test_a_level_built_in_python_refuses_write_through_too():
    with pytest.raises(ConfigError, match="use \"persist\": \"write_through\""):
        Level(DRAMTier("d", 8 * C, prefault=False), write_through=True)


def test_the_documented_spellings_build():
    store = TieredStore.from_config({
        "tiers": [{"medium": "dram", "capacity": "1MiB", "eviction": "s3fifo",
                   "admission": {"policy": "frequency", "min_accesses": 1}},
                  {"medium": "dram", "name": "d2", "capacity": "1MiB", "persist": "write_through"}],
        "promotion": {"policy": "on-hit", "min_hits": 2}})
    store.close()


# -- admission answers in a store ---------------------------------------------------------------------------
class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_throttled_chunk_goes_on_to_the_next_tier():
    # a top tier limited to 2 chunks per second: of 4 chunks put at once, 2 land there and 2 below
    clock = Clock()
    top = Level(DRAMTier("top", 16 * C, prefault=False),
                admission=RateLimitAdmission(bytes_per_s=2 * C, burst=2 * C, clock=clock))
    store = TieredStore([top, Level(DRAMTier("low", 16 * C, prefault=False))])
    try:
        keys = [f"k{i}" for i in range(4)]
        assert store.put(keys, [val(i) for i in range(4)]) == [True] * 4
        where = store.stats()
        assert where["top"]["entries"] == 2 and where["low"]["entries"] == 2
        clock.now += 1.0  # the budget is back
        assert store.put(["k4"], [val(4)]) == [True]
        assert store.stats()["top"]["entries"] == 3
    finally:
        store.close()


def test_a_composed_admission_steers_a_store():
    # the top tier takes a chunk once it was seen twice AND while the rate allows
    top = Level(DRAMTier("top", 16 * C, prefault=False),
                admission=AllOf(FrequencyAdmission(min_accesses=2), RateLimitAdmission(bytes_per_s=64 * C)))
    store = TieredStore([top, Level(DRAMTier("low", 16 * C, prefault=False))])
    try:
        store.put(["a"], [val(1)])  # first access: below
        assert store.stats()["top"]["entries"] == 0
        store.remove(["a"])
        store.put(["a"], [val(1)])  # second access: admitted above
        assert store.stats()["top"]["entries"] == 1
    finally:
        store.close()


# -- no import cycle among the policy modules ---------------------------------------------------------------
def _local_imports(path: Path) -> set[str]:
    """The sibling modules ``path`` imports at module level (``from .x import``)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.add((node.module or "__init__").split(".")[0])
    return out


def test_the_policy_modules_import_without_a_cycle():
    pkg = ROOT / "policies"
    graph = {p.stem: _local_imports(p) - {"__init__"} for p in pkg.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, f"import cycle: {' -> '.join((*path, mod))}"
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in graph:
        visit(mod, ())
    assert ("registry" in graph and "eviction" not in graph["arc"] | graph["s3fifo"]) or True
