"""Mooncake Store as a remote backend.

A Mooncake Store deployment is a *master* (metadata, allocation, eviction), the
clients that contribute memory *segments* to the pool, and the Transfer Engine
that moves bytes between a client's registered buffers and the segments.

Two modes (config ``"mode"``):
    ``embedded``    (default) this process contributes a segment of ``segment``
                    bytes; its objects live (partly) in its own memory and die
                    with it.  Objects in the own segment are read by a plain
                    copy (``local_reads``).
    ``standalone``  this process contributes nothing (segment 0): a node-local
                    ``mooncake_client`` process owns the pool memory (see
                    ``standalone.py``), so stored objects outlive the engine.
                    ``segment: 0`` selects this mode too.  Two attachments:
                    by default a client of the master whose every byte crosses
                    the Transfer Engine; with ``standalone_address`` (the
                    node's ``mooncake_client``) an IPC client that shares memory
                    with it (``setup_dummy``): the standalone client copies
                    between its segment and that memory, and the tier stages
                    every part through it (batches cut to fit ``ipc_buffer``).

Invariants this wrapper keeps (the client crashes or misbehaves otherwise):
    * chunk data moves only by pointer (``batch_put_from`` / ``batch_get_into``
      and their ``_multi_buffers`` variants) from memory registered with
      ``register``; never a numpy array or ``bytes``;
    * ``close()`` is called at most once, by the owning ``Session``, after the
      last call;
    * the ``mooncake`` module is imported only when a Mooncake tier is built.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.buffers import memmove_many
from tierkv.checksum import ReadSums
from tierkv.errors import ConfigError, install_hint
from tierkv.options import pop_bool, pop_choice, pop_size, pop_str
from tierkv.xxh3 import copy_and_sum

from .client import Backend, BackendSpec, Outcome, is_ip_literal, parse_host_port, tcp_reachable
from .options import pop_env_str, what

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
#: nominal capacity of a standalone pool when the config names none (informational: the tier is unmanaged)
STANDALONE_CAPACITY = 1 << 40

PROTOCOLS = ("tcp", "rdma", "ascend")
_SENTINEL = b"tierkv"
_SENTINEL_SLOT = 4096  # bytes at the end of the IPC shared memory kept for the sentinel
MODES = ("embedded", "standalone")


def outcome_of(code: int) -> Outcome:
    """Map a Mooncake per-key status code to an ``Outcome``."""
    if code >= 0:
        return Outcome.OK
    if code == EXISTS:
        return Outcome.EXISTS
    if code == NO_SPACE:
        return Outcome.NO_SPACE
    if code == NOT_FOUND:
        return Outcome.NOT_FOUND
    if code == LEASED:
        return Outcome.BUSY
    if -1099 <= code <= -900:  # RPC_FAIL, RPC_TIMEOUT and the rest of the RPC range
        return Outcome.UNAVAILABLE
    if -899 <= code <= -800:  # TRANSFER_FAIL and the rest of the transfer range
        return Outcome.PEER_UNREACHABLE
    return Outcome.ERROR


@dataclass
class MooncakeSettings:
    """Everything needed to bring up one Mooncake Store client."""

    master: str
    metadata_server: str
    protocol: str
    segment_bytes: int  # 0: standalone mode (contributes no segment)
    buffer_bytes: int
    local_hostname: str
    device_name: str = ""
    #: copy objects whose replica lies in this client's own host segment straight out of it
    local_reads: bool = False
    #: put new objects into this segment (a standalone client's segment name, "host:port") when it has room
    preferred_segment: str = ""
    #: standalone mode: attach to the node's standalone client at this address over IPC (shared memory)
    standalone_address: str = ""
    ipc_buffer_bytes: int = 64 << 20

    @property
    def master_addr(self) -> tuple[str, int]:
        return parse_host_port(self.master, "master")

    @property
    def standalone(self) -> bool:
        return self.segment_bytes == 0


def import_mooncake() -> Any:
    """The ``mooncake.store`` module, or ``ConfigError`` saying what to install."""
    try:
        from mooncake import store
    except ImportError as e:
        raise ConfigError(
            f"backend 'mooncake' needs the Mooncake Store client: {install_hint('mooncake')} "
            "(mooncake-transfer-engine-non-cuda; on Ascend mooncake-transfer-engine-npu) "
            f"and the system libraries libibverbs1 librdmacm1 libnuma1 ({e})"
        ) from e
    return store


class MooncakeClient:
    """One connected ``MooncakeDistributedStore``.  Every method blocks; callers run them off the caller's path."""

    outcome = staticmethod(outcome_of)

    def __init__(self, settings: MooncakeSettings) -> None:
        store = import_mooncake()
        if settings.protocol == "tcp" and is_ip_literal(settings.local_hostname):
            # The TCP transport must listen on the address it advertises to peers.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.local_hostname)
        self._store = store.MooncakeDistributedStore()
        self._config = store.ReplicateConfig()
        if settings.preferred_segment:
            self._config.preferred_segment = settings.preferred_segment
        self.settings = settings
        #: memory shared with the standalone client (IPC attachment): the only memory this client moves
        self.staging_memory: torch.Tensor | None = None
        self._shared: tuple[int, int] | None = None
        if settings.standalone_address:
            self._attach_ipc(settings)
        else:
            rc = self._store.setup(
                settings.local_hostname,
                settings.metadata_server,
                settings.segment_bytes,  # 0 in standalone mode: this client contributes no memory
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
        if (settings.local_reads and settings.segment_bytes and self._complete is not None
                and hasattr(self._store, "batch_get_replica_desc")):
            try:
                self._own_endpoint = str(self._store.get_hostname())
            except Exception:  # noqa: BLE001 (an older client without it: every read goes through the engine)
                self._own_endpoint = None

    def _attach_ipc(self, settings: MooncakeSettings) -> None:
        """Attach to the standalone client at ``standalone_address`` over IPC and map the shared memory.

        The standalone client moves bytes between its segment and this shared
        memory by local copies (no network); this process copies between the
        shared memory and its callers' buffers (the tier's staging path).
        """
        n = settings.ipc_buffer_bytes
        rc = self._store.setup_dummy(n, settings.buffer_bytes, settings.standalone_address)
        if rc != 0:
            raise ConnectionError(f"Mooncake IPC attach to {settings.standalone_address} failed with code {rc}")
        base = int(self._store.alloc_from_mem_pool(n) or 0)
        if not base or self._store.register_buffer(base, n) != 0:
            raise ConnectionError(f"Mooncake IPC attach: cannot map {n} bytes of shared memory")
        self._shared = (base, n)
        shared = torch.frombuffer((ctypes.c_uint8 * n).from_address(base), dtype=torch.uint8)
        # the tail holds the sentinel's bytes: bytes puts use the local buffer, which a reconnect to a
        # restarted standalone client does not share again (the shared pool it does)
        self._sentinel_ptr = base + n - _SENTINEL_SLOT
        shared[n - _SENTINEL_SLOT:n - _SENTINEL_SLOT + len(_SENTINEL)] = torch.frombuffer(
            bytearray(_SENTINEL), dtype=torch.uint8)
        self.staging_memory = shared[:n - _SENTINEL_SLOT]

    def _in_shared(self, ptr: int, nbytes: int) -> bool:
        return self._shared is not None and self._shared[0] <= ptr and ptr + nbytes <= sum(self._shared)

    @property
    def owns_segment(self) -> bool:
        """Closing a client that contributed a segment unmounts it (seconds, holding the interpreter lock)."""
        return self.settings.segment_bytes > 0

    def accepts_device(self, device_type: str) -> bool:
        """Whether parts on ``device_type`` can be moved without a host staging copy."""
        if self._shared is not None:
            return False  # over IPC only the shared memory moves: every part is staged through it
        if device_type == "cpu":
            return True
        return self.settings.protocol == "ascend" and device_type == "npu"

    def register(self, ptr: int, nbytes: int) -> int:
        if self._in_shared(ptr, nbytes):
            return 0  # registered once, at attach
        return self._store.register_buffer(ptr, nbytes)

    def unregister(self, ptr: int) -> int:
        if self._in_shared(ptr, 1):
            return 0
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
                   guard_s: float, sums: ReadSums | None = None) -> list[int]:
        """Copy each object whose replica lies in this client's own segment straight out of it.

        The segment is host memory of this process, so such a replica needs no
        transfer: one master call (``batch_get_replica_desc``) says where every
        replica lies and grants the same read lease a get takes, which keeps the
        replica from being removed or evicted while it is copied.  Per key: the
        bytes copied; -1 where a complete replica here has a size other than the
        one asked for (not the object the caller stored); or 0 where nothing was
        (no complete replica here, missing, or the copy ending more than
        ``guard_s`` after the lease was granted, which a get must then redo).
        Destinations must be host memory.  ``sums``, when given, gets the sum of
        each object copied, hashed as it is copied (``tierkv.xxh3.copy_and_sum``).
        """
        out = [0] * len(keys)
        own = self._own_endpoint
        if own is None or not keys:
            return out
        t0 = time.monotonic()
        descs = self._store.batch_get_replica_desc(list(keys))
        moves: list[tuple[int, int, int]] = []
        jobs: list[list[tuple[int, int, int]]] = []  # the moves of each object found (for a summed copy)
        found: list[int] = []
        for k, (key, p, s) in enumerate(zip(keys, ptrs, sizes)):
            addr = self._local_address(descs.get(key), sum(s), own)
            if addr is None:
                continue
            if addr < 0:
                out[k] = -1
                continue
            off = 0
            if sums is not None:
                moves = []
                jobs.append(moves)
            for ptr, n in zip(p, s):
                moves.append((ptr, addr + off, n))
                off += n
            found.append(k)
        if not found or time.monotonic() - t0 > guard_s:
            return out
        if sums is None:
            memmove_many(moves)
        else:
            got = copy_and_sum(jobs, [sums.nbytes[k] for k in found])
        if time.monotonic() - t0 <= guard_s:  # every copy ended while its lease held
            for k in found:
                out[k] = sum(sizes[k])
            if sums is not None:  # (only for bytes that stand: a get redoes the others)
                for k, h in zip(found, got):
                    sums.sums[k] = h
        return out

    def _local_address(self, replicas: Any, want: int, own: str) -> int | None:
        for r in replicas or ():
            try:
                if not r.is_memory_replica() or r.status != self._complete:
                    continue
                bd = r.get_memory_descriptor().buffer_descriptor
                if bd.transport_endpoint == own and bd.buffer_address:
                    return int(bd.buffer_address) if int(bd.size) == want else -1
            except Exception:  # noqa: BLE001 (a descriptor this wrapper does not understand: not local)
                continue
        return None

    def exists(self, keys: Sequence[str]) -> list[int]:
        return list(self._store.batch_is_exist(list(keys)))

    def remove(self, keys: Sequence[str]) -> list[int]:
        # never forced: a forced remove frees space a concurrent reader may still be copying from
        return list(self._store.batch_remove(list(keys), False))

    def put_sentinel(self, key: str) -> int:
        if self._shared is not None:
            return self._store.batch_put_from([key], [self._sentinel_ptr], [len(_SENTINEL)], self._config)[0]
        return self._store.put(key, _SENTINEL, self._config)

    def close(self) -> None:
        self._store.close()


def _pop_segment(tier: str, options: dict[str, Any]) -> int | None:
    """The ``segment`` option: bytes, 0 (standalone), or None when absent."""
    raw = options.pop("segment", None)
    if raw is None:
        return None
    if raw == 0 or (isinstance(raw, str) and raw.strip() in ("0", "0B", "0b")):
        return 0
    return pop_size({"segment": raw}, "segment", None, what(tier))


def pop_mooncake_settings(tier: str, medium: str, options: dict[str, Any],
                          default_protocol: str = "tcp") -> MooncakeSettings:
    """Mooncake connection options; ``TIERKV_MOONCAKE_*`` environment variables override the addresses."""
    w = what(tier)
    master = pop_env_str(tier, options, "master", None, "TIERKV_MOONCAKE_MASTER")
    parse_host_port(master, f"{w} option 'master'")
    metadata = pop_env_str(tier, options, "metadata_server", None, "TIERKV_MOONCAKE_METADATA_SERVER")
    protocol = pop_env_str(tier, options, "protocol", default_protocol, "TIERKV_MOONCAKE_PROTOCOL")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"{w} option 'protocol': expected one of {list(PROTOCOLS)}, got {protocol!r}")
    segment = _pop_segment(tier, options)
    mode = pop_choice(options, "mode", None, w, MODES)
    if mode is None:
        mode = "standalone" if segment == 0 else "embedded"
    if mode == "standalone":
        if medium != "dram_pool":
            raise ConfigError(f"{w} ({medium}): standalone mode pools host DRAM; it is a dram_pool mode")
        if segment:
            raise ConfigError(f"{w}: standalone mode contributes no segment (the standalone client owns the "
                              f"pool); drop 'segment' or set it to 0, got {segment}")
        segment = 0
    else:
        if segment == 0:
            raise ConfigError(f"{w}: embedded mode needs a segment (at least 16MiB); "
                              "'segment': 0 means standalone mode")
        segment = 512 << 20 if segment is None else segment
        if segment < MIN_SEGMENT:
            raise ConfigError(f"{w} option 'segment': must be at least 16MiB (Mooncake refuses smaller), "
                              f"got {segment}")
    buffer = pop_size(options, "buffer", 16 << 20, w)
    hostname = pop_env_str(tier, options, "local_hostname", "127.0.0.1", "TIERKV_MOONCAKE_LOCAL_HOSTNAME")
    device_name = pop_str(options, "device_name", "", w, allow_empty=True)
    preferred = pop_str(options, "preferred_segment", "", w, allow_empty=True)
    if preferred:
        parse_host_port(preferred, f"{w} option 'preferred_segment'")
    address = pop_str(options, "standalone_address", "", w, allow_empty=True)
    ipc_buffer = pop_size(options, "ipc_buffer", None, w)
    if address:
        if segment:
            raise ConfigError(f"{w} option 'standalone_address': IPC attachment is a standalone-mode option")
        parse_host_port(address, f"{w} option 'standalone_address'")
    elif ipc_buffer is not None:
        raise ConfigError(f"{w} option 'ipc_buffer': needs 'standalone_address' (IPC attachment)")
    local_reads = False
    if medium == "dram_pool":
        local_reads = pop_bool(options, "local_reads", None, w)
        if local_reads and segment == 0:
            raise ConfigError(f"{w} option 'local_reads': standalone mode has no segment of its own to read from")
        local_reads = segment > 0 if local_reads is None else local_reads
    return MooncakeSettings(master=master, metadata_server=metadata, protocol=protocol, segment_bytes=segment,
                            buffer_bytes=buffer, local_hostname=hostname, device_name=device_name,
                            local_reads=local_reads, preferred_segment=preferred, standalone_address=address,
                            ipc_buffer_bytes=ipc_buffer or 64 << 20)


class MooncakeBackend(Backend):
    """``"backend": "mooncake"``: a Mooncake Store client, embedded or attached to a standalone pool."""

    media = frozenset({"dram_pool", "remote_npu"})

    @classmethod
    def configure(cls, tier: str, medium: str, options: dict[str, Any], *, device: str = "cpu") -> BackendSpec:
        default_protocol = "ascend" if device.startswith("npu") else "tcp"
        settings = pop_mooncake_settings(tier, medium, options, default_protocol)
        import_mooncake()  # a missing client is a config error now, not a probe failure later
        # over IPC every call goes to the standalone client, which talks to the master itself
        host, port = (parse_host_port(settings.standalone_address, "standalone_address")
                      if settings.standalone_address else settings.master_addr)
        mode = "standalone" if settings.standalone else "embedded"
        if settings.standalone_address:
            mode += f" over IPC to {settings.standalone_address}"
        where = f", {device}" if medium != "dram_pool" else ""
        return BackendSpec(
            open_client=lambda: MooncakeClient(settings),
            reachable=lambda: tcp_reachable(host, port, 0.2),
            description=f"mooncake master {settings.master} ({settings.protocol}, {mode}{where})",
            default_capacity=STANDALONE_CAPACITY if settings.standalone else settings.segment_bytes,
            protocol=settings.protocol,
        )
