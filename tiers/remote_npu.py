"""``remote_npu``: KV held in other nodes' device memory, through Mooncake Store.

Each participating node contributes a segment of device memory to a Mooncake
Store pool; the Transfer Engine's ``ascend`` protocol (HIXL one-sided transfers)
moves chunks device to device.  On machines without Ascend devices the same code
runs with protocol ``tcp`` and host-memory segments, which is how it is tested.

In a chain it sits above ``dram_pool`` (faster, smaller).  Its objects live
under their own key prefix, so a ``remote_npu`` and a ``dram_pool`` tier on the
same master never alias each other's objects.

Config::

    {"medium": "remote_npu", "master": "10.0.0.1:50051",
     "metadata_server": "http://10.0.0.1:8080/metadata",
     "protocol": "ascend", "device": "npu:0", "segment": "8GiB"}

``device`` is where this process's chunks live ("cpu" or "npu:N"); with
``protocol: "ascend"`` it must be an NPU.  Every behaviour on faults (misses
while the master is down, background reconnection, refused writes on a full
pool) is ``RemotePoolTier``'s.
"""

from __future__ import annotations

from typing import Any

from tierkv.errors import ConfigError

from . import _mooncake as mc
from .dram_pool import RemotePoolTier, pop_mooncake_settings, pop_remote_options


class RemoteNPUTier(RemotePoolTier):
    """Other nodes' device memory as a tier (Mooncake Store segments, ``ascend`` protocol on Ascend)."""

    medium = "remote_npu"
    locality = "remote"
    key_tag = "remote_npu"

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "RemoteNPUTier":
        backend = options.pop("backend", "mooncake")
        if backend != "mooncake":
            raise ConfigError(f"tier {name!r} (remote_npu): backend must be 'mooncake', got {backend!r}")
        device = options.pop("device", "cpu")
        if not isinstance(device, str) or not (device == "cpu" or device.startswith("npu")):
            raise ConfigError(f"tier {name!r} (remote_npu): device must be 'cpu' or 'npu:N', got {device!r}")
        default_protocol = "ascend" if device.startswith("npu") else "tcp"
        settings = pop_mooncake_settings(name, options, default_protocol)
        if settings.protocol == "ascend" and not device.startswith("npu"):
            raise ConfigError(f"tier {name!r} (remote_npu): protocol 'ascend' moves device memory; "
                              f"set device to 'npu:N' (got {device!r})")
        capacity = cls.pop_capacity(name, options, settings.segment_bytes)
        common = pop_remote_options(name, options)
        cls.reject_unknown(name, options)
        mc.import_mooncake()
        host, port = settings.master_addr
        tier = cls(name, capacity, lambda: mc.MooncakeClient(settings),
                   reachable=lambda: mc.tcp_reachable(host, port, 0.2),
                   description=f"mooncake master {settings.master} ({settings.protocol}, {device})", **common)
        tier.device = device
        return tier
