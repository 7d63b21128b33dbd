"""``EngineConfig``: one SSD tier's configuration and the geometry it implies, a value fixed once the tier is open.

``SSDTier`` validates the options and builds it; every component that needs a setting or a size rule
holds it and reads it.  Two settings are learnt while the tier opens: ``direct_io`` (probed on the
file system: ``learn_direct_io``) and ``region_size`` (the directory's own, where it has regions:
``adopt_region_size``).  ``fix()`` ends that: from then on every assignment raises ``AttributeError``,
so no component can change a setting behind the others.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from . import format as F
from . import large as L

REGIONS_DIR = "regions"


class EngineConfig:
    """The settings of one SSD tier (as ``SSDTier`` validated them) and their geometry.  ``region_size`` is
    the directory's (its stored regions') once the tier is open; nothing changes after ``fix()``."""

    __slots__ = ("_fixed", "_geom", "capacity_bytes", "checksum", "compression", "direct_io", "fsync", "name",
                 "path", "region_size", "what")

    def __init__(self, name: str, what: str, path: str, capacity_bytes: int, region_size: int,
                 compression: Optional[str], checksum: str, fsync: str) -> None:
        self._fixed = False
        self.name = name
        self.what = what  # how messages name the tier: "tier 'x' (ssd)"
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.region_size = region_size
        self.compression = compression
        self.checksum = checksum
        self.fsync = fsync
        self.direct_io = False  # (probed by ``SSDTier`` before the open: ``learn_direct_io``)
        self._geom = L.Geometry.of(region_size)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_fixed", False):
            raise AttributeError(f"{self.what}: the configuration is fixed once the tier is open ({name})")
        object.__setattr__(self, name, value)

    # -- what the open learns ------------------------------------------------------------------
    def learn_direct_io(self, direct: bool) -> None:
        """Whether the directory takes O_DIRECT (``directory.probe_direct``), before the open."""
        self.direct_io = bool(direct)

    def adopt_region_size(self, region_size: int) -> None:
        """The region size of the directory's stored regions, which wins over the option (at open)."""
        self.region_size = region_size
        self._geom = L.Geometry.of(region_size)

    def fix(self) -> None:
        """The tier is open: no setting changes from now on."""
        self._fixed = True

    # -- geometry ------------------------------------------------------------------------------
    @property
    def usable(self) -> int:
        """Bytes of a region that records and the summary may take (header block and footer excluded)."""
        return self.region_size - 2 * F.BLOCK - F.FOOTER

    @property
    def max_slot(self) -> int:
        """The most one record takes (``F.measure``): an eighth of a region."""
        return self.usable // 8

    def regions_needed(self) -> int:
        """Region files the capacity provisions: ``ceil(capacity / (usable - max_slot)) + 2``."""
        per = self.usable - self.max_slot
        return -(-self.capacity_bytes // per) + 2

    def geometry(self) -> L.Geometry:
        """The size rule of this directory's region size (``large.py``)."""
        return self._geom

    @property
    def regions_dir(self) -> str:
        return os.path.join(self.path, REGIONS_DIR)

    def ensure_dirs(self) -> None:
        os.makedirs(self.regions_dir, mode=0o700, exist_ok=True)
