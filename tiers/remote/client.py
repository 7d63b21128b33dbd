"""What every remote backend provides: a blocking client, its outcomes, and a factory.

A backend is a small adapter over one distributed object store's client library.
It maps the library's status codes onto ``Outcome`` (the only vocabulary the
pool tier understands) and hands the tier a ``BackendSpec``: how to open a
client, how to tell cheaply whether the service is reachable at all, and a few
facts (description, default capacity, key length limit).

This module is the one place both backends import; backends never import each
other, and the tier never branches on a backend's name.

Ownership: a ``RemoteClient`` belongs to exactly one ``Session`` (``session.py``),
which calls it from its worker threads and calls ``close()`` at most once, after
the last call has returned.  Every client method may block for seconds.
"""

from __future__ import annotations

import enum
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from tierkv.errors import ConfigError


class Outcome(enum.Enum):
    """What one per-key status code means to the tier."""

    OK = "ok"                        # done (for a get: the code is the byte count)
    EXISTS = "exists"                # the key already holds an object: stored, by dedup
    NOT_FOUND = "not_found"          # no such object
    NO_SPACE = "no_space"            # the pool is full (for now)
    BUSY = "busy"                    # the object is leased by readers; retry later
    UNAVAILABLE = "unavailable"      # the service (master) did not answer: the tier goes down
    PEER_UNREACHABLE = "peer"        # the memory holding the object is unreachable (its owner died)
    ERROR = "error"                  # anything else: this key failed, the service is fine


#: outcomes that say the whole backend is unusable right now (the tier turns unavailable)
FATAL = frozenset({Outcome.UNAVAILABLE, Outcome.PEER_UNREACHABLE})


@runtime_checkable
class RemoteClient(Protocol):
    """One connected backend client.  Pointers are addresses of registered memory; sizes in bytes.

    ``ptrs[i]`` / ``sizes[i]`` are the parts of object ``i``, concatenated in order.
    Batch calls answer one integer code per key; ``get`` answers the byte count on
    success.  ``devices[i]`` is where object ``i``'s parts live ("cpu", "npu").

    Optional members the tier looks for:
        ``staging_memory``  a host tensor, the only memory this client can move
                            (every part is staged through it; batches must fit)
        ``owns_segment``    True when closing the client unmounts pool memory it
                            contributed (slow; a wedged client is then left open)
        ``reads_locally`` / ``read_local(keys, ptrs, sizes, guard_s)``
                            copy objects held in this client's own segment directly
    """

    def outcome(self, code: int) -> Outcome: ...
    def accepts_device(self, device_type: str) -> bool: ...
    def register(self, ptr: int, nbytes: int) -> int: ...
    def unregister(self, ptr: int) -> int: ...
    def put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            devices: Sequence[str] | None = None) -> list[int]: ...
    def get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            devices: Sequence[str] | None = None) -> list[int]: ...
    def exists(self, keys: Sequence[str]) -> list[int]: ...
    def remove(self, keys: Sequence[str]) -> list[int]: ...
    def put_sentinel(self, key: str) -> int: ...
    def close(self) -> None: ...


@dataclass
class BackendSpec:
    """A configured backend, ready for ``RemotePoolTier``."""

    open_client: Callable[[], RemoteClient]
    description: str
    #: cheap check run before every (re)connection attempt: False means "do not even try"
    reachable: Callable[[], bool] = lambda: True
    #: the tier's capacity when the config names none (None: the config must say)
    default_capacity: int | None = None
    max_key_len: int = 4096
    #: transfer protocol, where the backend has one (media check it against their device)
    protocol: str | None = None


class Backend:
    """A remote backend: parses its options and builds a ``BackendSpec``.  Listed in ``backends.BACKENDS``."""

    #: media this backend can serve
    media: ClassVar[frozenset[str]] = frozenset({"dram_pool"})

    @classmethod
    def configure(cls, tier: str, medium: str, options: dict[str, Any], *, device: str = "cpu") -> BackendSpec:
        """Pop this backend's options from ``options`` (the rest is the tier's) and check them."""
        raise NotImplementedError


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address as written (not a name to resolve)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def parse_host_port(value: Any, what: str) -> tuple[str, int]:
    """``"host:port"`` → (host, port); raises ``ConfigError`` naming ``what``."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{what}: expected 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit():
        raise ConfigError(f"{what}: port of {value!r} is not a number")
    p = int(port)
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
