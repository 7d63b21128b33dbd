"""The located half of ``Tier`` (allocate / write_at / read_at / free_at / views_at), run against every medium
that implements it: ``dram`` and ``hbm`` (the slab), as the level uses them."""

from __future__ import annotations

import pytest
import torch
from tier_conformance import LocatedTierConformance

from tierkv.tiers import MEDIA, medium_class
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.hbm import HBMTier


class TestDRAM(LocatedTierConformance):
    @pytest.fixture
    def make_tier(self, factory):
        return lambda cap: factory(DRAMTier("dram", cap))

    @staticmethod
    def model_tier(cap):
        return DRAMTier("dram", cap)


class TestDRAMUnfaulted(LocatedTierConformance):
    """Pages left untouched until first use (``prefault: false``)."""

    @pytest.fixture
    def make_tier(self, factory):
        return lambda cap: factory(DRAMTier("dram", cap, prefault=False))

    @staticmethod
    def model_tier(cap):
        return DRAMTier("dram", cap, prefault=False)


class TestHBMOnCPU(LocatedTierConformance):
    @pytest.fixture
    def make_tier(self, factory):
        return lambda cap: factory(HBMTier("hbm", cap, device="cpu"))

    @staticmethod
    def model_tier(cap):
        return HBMTier("hbm", cap, device="cpu")


class DevicePathSlab(HBMTier):
    """``hbm``'s device code path (no raw-address copies: views cut per call and ``copy_many``; no host views),
    run on host memory: the logic a CUDA or NPU slab runs, checked where no such device is."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._host = False


# same shape as TestHBMOnCPU: pytest collects one class per tier, each naming its tier twice (fixture and model)
class TestHBMDevicePathOnCPU(LocatedTierConformance):
    @pytest.fixture
    def make_tier(self, factory):
        return lambda cap: factory(DevicePathSlab("hbm", cap, device="cpu"))

    @staticmethod
    def model_tier(cap):
        return DevicePathSlab("hbm", cap, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
class TestHBMOnCUDA(LocatedTierConformance):
    """Device memory: copies through ``copy_many``, no host views."""

    @pytest.fixture
    def make_tier(self, factory):
        return lambda cap: factory(HBMTier("hbm", cap, device="cuda"))

    @staticmethod
    def model_tier(cap):
        return HBMTier("hbm", cap, device="cuda")


COVERED = {DRAMTier, HBMTier}


def test_every_located_medium_is_in_this_suite():
    """A built-in medium that declares ``located = True`` gets a class above."""
    located = set()
    for name in MEDIA:
        try:
            cls = medium_class(name)
        except Exception:  # a medium whose client is not installed here (a remote pool)
            continue
        if cls.located:
            located.add(cls)
    assert located and located <= COVERED, f"located media without a conformance run: {located - COVERED}"
