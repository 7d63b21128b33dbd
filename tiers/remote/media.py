"""The remote media: ``dram_pool`` (pooled host DRAM) and ``remote_npu`` (other nodes' device memory).

Both are ``RemotePoolTier`` over a backend chosen from the backend table
(``backends.BACKENDS``); they differ in their key prefix (the two never alias
each other's objects on one pool), the backends they accept and, for
``remote_npu``, the device their chunks live on.  ``docs/media.md`` lists every
option.

``dram_pool``::

    {"medium": "dram_pool", "backend": "mooncake", "master": "10.0.0.1:50051",
     "metadata_server": "http://10.0.0.1:8080/metadata", "segment": "8GiB"}

    # attached to a node-local standalone pool (mooncake_client owns the memory)
    {"medium": "dram_pool", "mode": "standalone", "master": "10.0.0.1:50051",
     "metadata_server": "http://10.0.0.1:8080/metadata"}

``remote_npu``::

    {"medium": "remote_npu", "master": "10.0.0.1:50051",
     "metadata_server": "http://10.0.0.1:8080/metadata",
     "protocol": "ascend", "device": "npu:0", "segment": "8GiB"}

``device`` is where this process's chunks live ("cpu" or "npu:N"); with
``protocol: "ascend"`` (HIXL one-sided transfers) it must be an NPU.  On
machines without Ascend devices the same code runs with ``tcp`` and host-memory
segments, which is how it is tested.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from tierkv.errors import ConfigError
from tierkv.options import pop_str

from ..base import Locality
from .backends import DEFAULT_BACKEND, backend_class
from .client import BackendSpec
from .options import pop_remote_options, what
from .pool import RemotePoolTier

_M = TypeVar("_M", bound="_RemoteMedium")


class _RemoteMedium(RemotePoolTier):
    """Builds a remote medium from config through the backend table."""

    @classmethod
    def _build(cls: type[_M], name: str, options: dict[str, Any], device: str = "cpu",
               check: Callable[[BackendSpec], None] | None = None) -> _M:
        backend = options.pop("backend", DEFAULT_BACKEND)
        spec = backend_class(backend, name, cls.medium).configure(name, cls.medium, options, device=device)
        if check is not None:
            check(spec)
        capacity = cls.pop_capacity(name, options, spec.default_capacity)
        common = pop_remote_options(name, options)
        cls.reject_unknown(name, options)
        tier = cls(name, capacity, spec.open_client, reachable=spec.reachable, description=spec.description,
                   max_key_len=spec.max_key_len, **common)
        return tier


class DramPoolTier(_RemoteMedium):
    """Host DRAM pooled across nodes (Mooncake Store by default; MemFabric memcache on Ascend)."""

    medium = "dram_pool"
    locality = Locality.REMOTE
    key_tag = "dram_pool"

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "DramPoolTier":
        return cls._build(name, options)


class RemoteNPUTier(_RemoteMedium):
    """Other nodes' device memory as a tier (Mooncake Store segments, ``ascend`` protocol on Ascend)."""

    medium = "remote_npu"
    locality = Locality.REMOTE
    key_tag = "remote_npu"
    device = "cpu"

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "RemoteNPUTier":
        device = pop_str(options, "device", "cpu", what(name))
        if not (device == "cpu" or device.startswith("npu")):
            raise ConfigError(f"{what(name)} (remote_npu) option 'device': expected 'cpu' or 'npu:N', got {device!r}")

        def check(spec: BackendSpec) -> None:
            if spec.protocol == "ascend" and not device.startswith("npu"):
                raise ConfigError(f"{what(name)} (remote_npu): protocol 'ascend' moves device memory; "
                                  f"set device to 'npu:N' (got {device!r})")

        tier = cls._build(name, options, device, check)
        tier.device = device
        return tier
