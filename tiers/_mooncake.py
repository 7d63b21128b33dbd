"""Mooncake Store as a remote-tier backend.

A Mooncake Store deployment is a *master* (metadata, allocation, eviction), any
number of *clients* that each contribute a memory segment to the pool, and the
Transfer Engine that moves bytes between a client's buffers and the segments.
This module wraps one ``mooncake.store.MooncakeDistributedStore`` client behind
the small ``RemoteClient`` surface that ``tiers.dram_pool.RemotePoolTier`` uses.

Invariants this wrapper keeps (the client crashes or misbehaves otherwise):
    * it never hands a numpy array or ``bytes`` to ``put`` for chunk data: chunks
      move only by pointer (``batch_put_from`` / ``batch_get_into`` and their
      ``_multi_buffers`` variants) from memory registered with ``register``;
    * ``close()`` is called at most once, and the owner (``_Session`` in
      ``dram_pool``) guarantees no call is in flight or follows it;
    * the ``mooncake`` module is imported only when a Mooncake tier is built.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.buffers import memmove_many
from tierkv.errors import ConfigError

#: Mooncake error codes this backend distinguishes (``mooncake-store`` ``ErrorCode``)
NO_SPACE = -200
BAD_ARGUMENT = -600
NOT_FOUND = -704
EXISTS = -705
LEASED = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

#: the smallest segment a Mooncake client accepts
MIN_SEGMENT = 16 << 20

#: outcome classes shared by every backend (see ``RemoteClient.classify``)
OK, DUPLICATE, FULL, MISSING, BUSY, DOWN, PEER, ERROR = "ok", "exists", "full", "missing", "busy", "down", "peer", "error"


def classify_mooncake(code: int) -> str:
    """Map a Mooncake per-key status code to an outcome class."""
    if code >= 0:
        return OK
    if code == EXISTS:
        return DUPLICATE
    if code == NO_SPACE:
        return FULL
    if code == NOT_FOUND:
        return MISSING
    if code == LEASED:
        return BUSY
    if code in (RPC_FAIL, RPC_TIMEOUT) or -1099 <= code <= -900:
        return DOWN
    if code == TRANSFER_FAIL or -899 <= code <= -800:
        return PEER
    return ERROR


def parse_host_port(value: str, what: str) -> tuple[str, int]:
    """``"host:port"`` → (host, port); raises ``ConfigError`` naming ``what``."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{what}: expected 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"{what}: port of {value!r} is not a number") from None
    if not host or not 0 < p < 65536:
        raise ConfigError(f"{what}: expected 'host:port', got {value!r}")
    return host, p


def tcp_reachable(host: str, port: int, timeout: float) -> bool:
    """True when a TCP connection to (host, port) opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class MooncakeSettings:
    """Everything needed to bring up one Mooncake Store client."""

    master: str
    metadata_server: str
    protocol: str
    segment_bytes: int
    buffer_bytes: int
    local_hostname: str
    device_name: str = ""
    #: copy objects whose replica lies in this client's own host segment straight out of it
    local_reads: bool = False

    @property
    def master_addr(self) -> tuple[str, int]:
        return parse_host_port(self.master, "master")


def import_mooncake() -> Any:
    """The ``mooncake.store`` module, or ``ConfigError`` saying what to install."""
    try:
        from mooncake import store  # noqa: PLC0415 (imported only when selected)
    except ImportError as e:
        raise ConfigError(
            "backend 'mooncake' needs the Mooncake Store client: pip install "
            "'tierkv[mooncake]' (mooncake-transfer-engine-non-cuda; on Ascend mooncake-transfer-engine-npu) "
            f"and the system libraries libibverbs1 librdmacm1 libnuma1 ({e})"
        ) from e
    return store


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class MooncakeClient:
    """One connected ``MooncakeDistributedStore``.  Every method blocks; callers run them off the caller's path."""

    classify = staticmethod(classify_mooncake)

    def __init__(self, settings: MooncakeSettings) -> None:
        store = import_mooncake()
        if settings.protocol == "tcp" and _is_ip_literal(settings.local_hostname):
            # The TCP transport must listen on the address it advertises to peers.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.local_hostname)
        self._store = store.MooncakeDistributedStore()
        self._config = store.ReplicateConfig()
        self.settings = settings
        rc = self._store.setup(
            settings.local_hostname,
            settings.metadata_server,
            settings.segment_bytes,
            settings.buffer_bytes,
            settings.protocol,
            settings.device_name,
            settings.master,
        )
        if rc != 0:
            # setup failed: the client holds no segment; it is dropped without further calls
            raise ConnectionError(
                f"Mooncake setup failed with code {rc} (master {settings.master}, "
                f"metadata {settings.metadata_server}, protocol {settings.protocol})"
            )
        self._complete = getattr(getattr(store, "ReplicaStatus", None), "COMPLETE", None)
        self._own_endpoint: str | None = None
        if settings.local_reads and self._complete is not None and hasattr(self._store, "batch_get_replica_desc"):
            try:
                self._own_endpoint = str(self._store.get_hostname())
            except Exception:  # noqa: BLE001 (an older client without it: every read goes through the engine)
                self._own_endpoint = None

    def accepts_device(self, device_type: str) -> bool:
        """Whether parts on ``device_type`` can be moved without a host staging copy."""
        if device_type == "cpu":
            return True
        return self.settings.protocol == "ascend" and device_type == "npu"

    def register(self, ptr: int, nbytes: int) -> int:
        return self._store.register_buffer(ptr, nbytes)

    def unregister(self, ptr: int) -> int:
        return self._store.unregister_buffer(ptr)

    def put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            devices: Sequence[str] | None = None) -> list[int]:
        keys = list(keys)
        if all(len(p) == 1 for p in ptrs):
            return list(self._store.batch_put_from(keys, [p[0] for p in ptrs], [s[0] for s in sizes], self._config))
        return list(self._store.batch_put_from_multi_buffers(keys, [list(p) for p in ptrs],
                                                             [list(s) for s in sizes], self._config))

    def get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            devices: Sequence[str] | None = None) -> list[int]:
        keys = list(keys)
        if all(len(p) == 1 for p in ptrs):
            return list(self._store.batch_get_into(keys, [p[0] for p in ptrs], [s[0] for s in sizes]))
        return list(self._store.batch_get_into_multi_buffers(keys, [list(p) for p in ptrs], [list(s) for s in sizes]))

    @property
    def reads_locally(self) -> bool:
        return self._own_endpoint is not None

    def read_local(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
                   guard_s: float) -> list[int]:
        """Copy each object whose replica lies in this client's own segment straight out of it.

        The segment is host memory of this process, so such a replica needs no
        transfer: one master call (``batch_get_replica_desc``) says where every
        replica lies and grants the same read lease a get takes, which keeps the
        replica from being removed or evicted while it is copied.  Per key: the
        bytes copied, or 0 where nothing was (no complete replica here, missing, a
        size other than the one asked for, or the copy ending more than ``guard_s``
        after the lease was granted, which a get must then redo).  Destinations
        must be host memory.
        """
        out = [0] * len(keys)
        own = self._own_endpoint
        if own is None or not keys:
            return out
        t0 = time.monotonic()
        descs = self._store.batch_get_replica_desc(list(keys))
        moves: list[tuple[int, int, int]] = []
        found: list[int] = []
        for k, (key, p, s) in enumerate(zip(keys, ptrs, sizes)):
            addr = self._local_address(descs.get(key), sum(s), own)
            if addr is None:
                continue
            off = 0
            for ptr, n in zip(p, s):
                moves.append((ptr, addr + off, n))
                off += n
            found.append(k)
        if not found or time.monotonic() - t0 > guard_s:
            return out
        memmove_many(moves)
        if time.monotonic() - t0 <= guard_s:  # every copy ended while its lease held
            for k in found:
                out[k] = sum(sizes[k])
        return out

    def _local_address(self, replicas: Any, want: int, own: str) -> int | None:
        for r in replicas or ():
            try:
                if not r.is_memory_replica() or r.status != self._complete:
                    continue
                bd = r.get_memory_descriptor().buffer_descriptor
                if bd.transport_endpoint == own and int(bd.size) == want and bd.buffer_address:
                    return int(bd.buffer_address)
            except Exception:  # noqa: BLE001 (a descriptor this wrapper does not understand: not local)
                continue
        return None

    def exists(self, keys: Sequence[str]) -> list[int]:
        return list(self._store.batch_is_exist(list(keys)))

    def remove(self, keys: Sequence[str]) -> list[int]:
        # never forced: a forced remove frees space a concurrent reader may still be copying from
        return list(self._store.batch_remove(list(keys), False))

    def put_sentinel(self, key: str) -> int:
        return self._store.put(key, b"tierkv", self._config)

    def close(self) -> None:
        self._store.close()
