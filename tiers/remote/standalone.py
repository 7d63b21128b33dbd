"""A standalone Mooncake pool on this node: a ``mooncake_client`` process that owns the pool memory.

In standalone mode engines attach to the pool with ``"mode": "standalone"`` and
contribute no memory of their own (segment 0), so what they store outlives them:
a restarted engine finds the pool intact.  The memory belongs to one
``mooncake_client`` process per node (shipped beside ``mooncake_master`` in the
Mooncake wheel), started by an operator, a service manager, or this module::

    mooncake_client --master_server_address=10.0.0.1:50051 \\
        --metadata_server=http://10.0.0.1:8080/metadata \\
        --global_segment_size=8GB --local_buffer_size=0 \\
        --host=10.0.0.2 --port=50052 --protocol=tcp

(``MC_TCP_BIND_ADDRESS=<host>`` makes the tcp transport listen where it
advertises.)  The same from Python or the command line::

    pool = start_pool("10.0.0.1:50051", "http://10.0.0.1:8080/metadata", "8GiB", host="10.0.0.2")
    python -m tierkv.tiers.remote.standalone --master 10.0.0.1:50051 \\
        --metadata-server http://10.0.0.1:8080/metadata --segment 8GiB --host 10.0.0.2

Engines on other nodes attach with ``pool.tier_config()`` (through the Transfer
Engine); engines on this node do better with ``pool.tier_config(ipc=True)``
(over IPC and shared memory with this process).

``StandalonePool.start`` returns once the segment is mounted: the master's HTTP
endpoint (``master_http``, the master's ``--metrics_port``, default 9003) lists
a segment it did not list before.  Where that endpoint cannot be reached it
returns ``mount_grace`` seconds after the client's service port opened, and
``segment`` stays None.

Ownership: a ``StandalonePool`` owns its process; ``stop()`` (and leaving the
``with`` block) ends it, SIGKILL after a grace period.  Objects in its segment
die with it.  The process is started in its own session, so a signal to the
caller's process group does not reach it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import Any, cast

from tierkv.errors import ConfigError, install_hint
from tierkv.options import check_choice, check_float, check_int, check_str
from tierkv.units import parse_size

from .client import is_ip_literal, parse_host_port, tcp_reachable

DEFAULT_PORT = 50052
DEFAULT_MASTER_HTTP_PORT = 9003


def client_binary() -> str | None:
    """Path of the ``mooncake_client`` executable the Mooncake wheel ships, or None."""
    spec = importlib.util.find_spec("mooncake")
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    dirs.append(os.path.dirname(sys.executable))
    for d in dirs:
        p = os.path.join(d, "mooncake_client")
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return shutil.which("mooncake_client")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _mooncake_size(nbytes: int) -> str:
    """A size as ``mooncake_client`` reads it (its "MB"/"GB" are binary units)."""
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


class StandalonePool:
    """One ``mooncake_client`` process owning ``segment`` bytes of pool memory; a context manager."""

    def __init__(self, master: str, metadata_server: str, segment: int | str = "8GiB", *,
                 host: str = "127.0.0.1", port: int | None = None, protocol: str = "tcp",
                 device_names: str = "", master_http: str | None = None, threads: int = 1,
                 binary: str | None = None, log_path: str | None = None, mount_grace: float = 1.0) -> None:
        parse_host_port(master, "standalone pool master")
        check_str(metadata_server, "standalone pool metadata_server")
        check_choice(protocol, "standalone pool protocol", ("tcp", "rdma", "ascend"))
        self.master, self.metadata_server, self.protocol = master, metadata_server, protocol
        self.segment_bytes = parse_size(segment, "standalone pool segment")
        self.host = check_str(host, "standalone pool host")
        self.device_names = check_str(device_names, "standalone pool device_names", allow_empty=True)
        self.threads = check_int(threads, "standalone pool threads", min_value=1)
        self.port = check_int(port if port is not None else _free_port(host), "standalone pool port",
                              min_value=1, max_value=65535)
        mount_grace = check_float(mount_grace, "standalone pool mount_grace", min_value=0.0)
        mhost = parse_host_port(master, "master")[0]
        self.master_http = master_http or f"{mhost}:{DEFAULT_MASTER_HTTP_PORT}"
        parse_host_port(self.master_http, "standalone pool master_http")
        self.binary = binary or client_binary()
        self.mount_grace = mount_grace
        self._own_log = log_path is None
        self.log_path = log_path or tempfile.NamedTemporaryFile(  # noqa: SIM115 - the handle outlives this block on purpose
            prefix="mooncake_client-", suffix=".log", delete=False).name
        self.proc: subprocess.Popen | None = None
        #: the mounted segment's name ("host:port") as the master lists it, once known
        self.segment: str | None = None

    # -- the process ------------------------------------------------------------
    @property
    def command(self) -> list[str]:
        """The ``mooncake_client`` command line this pool runs."""
        return [self.binary or "mooncake_client",
                f"--master_server_address={self.master}", f"--metadata_server={self.metadata_server}",
                f"--global_segment_size={_mooncake_size(self.segment_bytes)}", "--local_buffer_size=0",
                f"--host={self.host}", f"--port={self.port}", f"--protocol={self.protocol}",
                f"--device_names={self.device_names}", f"--threads={self.threads}"]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        env.setdefault("GLOG_minloglevel", "2")
        if self.protocol == "tcp" and is_ip_literal(self.host):
            env["MC_TCP_BIND_ADDRESS"] = self.host  # listen where the segment is advertised
        return env

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> "StandalonePool":
        """Start the process and return once its segment is mounted; raises ``RuntimeError`` otherwise."""
        if self.running:
            return self
        if self.binary is None:
            raise RuntimeError(f"mooncake_client not found: install the Mooncake wheel "
                               f"({install_hint('mooncake')}), which ships it beside mooncake_master")
        before = self._segments()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=self.environment(), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
        end = time.monotonic() + timeout
        try:
            self._wait(lambda: tcp_reachable(self.host, self.port, 0.2), end, "open its service port")
            if before is None:
                time.sleep(self.mount_grace)  # no master endpoint to ask: give the mount its usual time
                self.segment = None
            else:
                self._wait(lambda: bool(self._new_segments(before)), end, "mount its segment")
                self.segment = sorted(self._new_segments(before))[0]
        except BaseException:
            self.kill()
            raise
        return self

    def _wait(self, pred: Any, end: float, what: str) -> None:
        while not pred():
            if not self.running:
                raise RuntimeError(f"mooncake_client exited (code {cast(subprocess.Popen, self.proc).returncode}) "
                                   f"before it could {what}; log: {self.log_tail()}")
            if time.monotonic() > end:
                raise RuntimeError(f"mooncake_client did not {what} in time; log: {self.log_tail()}")
            time.sleep(0.05)

    def _segments(self) -> set[str] | None:
        """Segment names the master lists, or None when its HTTP endpoint does not answer."""
        try:
            with urllib.request.urlopen(f"http://{self.master_http}/get_all_segments", timeout=1.0) as r:
                return {s.strip() for s in r.read().decode().split() if s.strip()}
        except (OSError, ValueError):
            return None

    def _new_segments(self, before: set[str]) -> set[str]:
        now = self._segments()
        return (now - before) if now is not None else set()

    def stop(self, grace: float = 5.0) -> None:
        """End the process (SIGTERM, SIGKILL after ``grace`` seconds); its objects are gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        """Crash the process (SIGKILL), as a fault would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, timeout: float = 30.0) -> "StandalonePool":
        self.kill()
        self.proc = None
        end = time.monotonic() + timeout
        while True:  # the service port was ours a moment ago; the kernel may hold it briefly
            try:
                return self.start(max(1.0, end - time.monotonic()))
            except RuntimeError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # -- what engines need -------------------------------------------------------
    def tier_config(self, ipc: bool = False, **extra: Any) -> dict[str, Any]:
        """A ``dram_pool`` tier config attached to this pool (standalone mode).

        With ``ipc`` the engine talks to this client over IPC and shared memory
        (same node only) instead of through the Transfer Engine."""
        cfg: dict[str, Any] = {"medium": "dram_pool", "backend": "mooncake", "mode": "standalone",
                               "master": self.master, "metadata_server": self.metadata_server,
                               "protocol": self.protocol, "capacity": self.segment_bytes}
        if ipc:
            cfg["standalone_address"] = f"{self.host}:{self.port}"
        if is_ip_literal(self.host):
            cfg["local_hostname"] = self.host
        cfg.update(extra)
        return cfg

    def __enter__(self) -> "StandalonePool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        if self._own_log:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass


def start_pool(master: str, metadata_server: str, segment: int | str = "8GiB", **kwargs: Any) -> StandalonePool:
    """Start a standalone pool (see ``StandalonePool`` for the keyword arguments) and return it, mounted."""
    return StandalonePool(master, metadata_server, segment, **kwargs).start()


def main(argv: Sequence[str] | None = None) -> int:
    """``tierkv pool start``: run a standalone pool in the foreground until SIGINT / SIGTERM."""
    ap = argparse.ArgumentParser(prog="tierkv pool start", description=main.__doc__)
    ap.add_argument("--master", required=True, help="the mooncake_master RPC address, host:port")
    ap.add_argument("--metadata-server", required=True, help="e.g. http://10.0.0.1:8080/metadata")
    ap.add_argument("--segment", default="8GiB", help="pool memory this node contributes (default 8GiB)")
    ap.add_argument("--host", default="127.0.0.1", help="address the segment is advertised (and served) on")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"client service port (default {DEFAULT_PORT})")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma", "ascend"])
    ap.add_argument("--device-names", default="", help="RDMA / NPU device names, where the protocol needs them")
    ap.add_argument("--master-http", default=None,
                    help=f"the master's HTTP (metrics) address, to see the mount (default <master host>:"
                         f"{DEFAULT_MASTER_HTTP_PORT})")
    ap.add_argument("--log", default=None, help="mooncake_client's log file (default: a temp file)")
    ap.add_argument("--dry-run", action="store_true", help="print the command line and exit")
    args = ap.parse_args(argv)
    try:
        pool = StandalonePool(args.master, args.metadata_server, args.segment, host=args.host, port=args.port,
                              protocol=args.protocol, device_names=args.device_names,
                              master_http=args.master_http, log_path=args.log)
    except ConfigError as e:
        print(f"tierkv pool start: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(pool.command))
        return 0
    stop = {"now": False}

    def on_signal(_sig: int, _frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        pool.start()
    except RuntimeError as e:
        print(f"tierkv pool start: {e}", file=sys.stderr)
        return 1
    try:
        print(json.dumps({"pool": "started", "pid": cast(subprocess.Popen, pool.proc).pid, "segment": pool.segment,
                          "log": pool.log_path, "tier_config": pool.tier_config(),
                          "tier_config_ipc": pool.tier_config(ipc=True)}), flush=True)
        while not stop["now"] and pool.running:
            time.sleep(0.2)
        code = 0 if stop["now"] else (cast(subprocess.Popen, pool.proc).returncode or 1)  # (started)
        if code:
            print(f"tierkv pool start: mooncake_client exited with code {cast(subprocess.Popen, pool.proc).returncode}; "
                  f"log: {pool.log_tail()}", file=sys.stderr)
        return code
    finally:
        pool.stop()


if __name__ == "__main__":
    sys.exit(main())
