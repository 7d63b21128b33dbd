"""Real ``mooncake_master`` processes on 127.0.0.1 for tests.

    with MooncakeMaster() as m:
        cfg = m.tier_config(segment="64MiB")       # a dram_pool tier config dict
        tier = DramPoolTier.from_config("pool", {k: v for k, v in cfg.items() if k != "medium"})
        with m.standalone_pool("256MiB") as pool:   # a mooncake_client owning the pool memory
            cfg = pool.tier_config()                # a dram_pool in standalone mode (segment 0)

Each master gets free loopback ports of its own (RPC, HTTP metadata, metrics),
and is always stopped (SIGKILL after a grace period) when the ``with`` block or
the fixture ends, failures included.  ``kill()`` / ``restart()`` simulate a
crash and a restart on the same ports.  Everything skips with the reason when
the ``mooncake`` module or the ``mooncake_master`` binary is missing.

Environment the clients need (set by ``client_env()``, applied by the fixtures):
``MC_TCP_BIND_ADDRESS=127.0.0.1`` (the TCP transport listens on loopback) and
``MC_LOG_LEVEL=ERROR``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
from netutil import HOST, free_port, wait_port


def client_env() -> dict[str, str]:
    """Environment variables a Mooncake client process needs to work on loopback."""
    return {"MC_TCP_BIND_ADDRESS": HOST, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


def master_binary() -> str | None:
    """Path of the ``mooncake_master`` executable the ``mooncake`` wheel ships, or None."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = os.path.join(d, "mooncake_master")
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    for cand in (os.path.join(os.path.dirname(sys.executable), "mooncake_master"), shutil.which("mooncake_master")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def missing_reason() -> str | None:
    """Why Mooncake tests cannot run here (None when they can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake client not importable ({e}); pip install mooncake-transfer-engine-non-cuda " \
               "and apt-get install libibverbs1 librdmacm1 libnuma1"
    if master_binary() is None:
        return "mooncake_master binary not found (installed by the mooncake-transfer-engine wheel)"
    return None


def wait_for(pred, timeout: float, step: float = 0.05) -> bool:
    """Whether ``pred()`` became true within ``timeout`` s (asked every ``step`` s, and once more at the end): a
    pool's state settles in the master's own time."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def require_mooncake() -> None:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)




class MooncakeMaster:
    """One ``mooncake_master`` on loopback; a context manager that always stops it."""

    def __init__(self, *extra_args: str, client_ttl: int | None = 2, lease_ttl_ms: int | None = None) -> None:
        require_mooncake()
        for k, v in client_env().items():
            os.environ.setdefault(k, v)
        self.binary = master_binary()
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.extra_args = list(extra_args)
        if client_ttl is not None:
            self.extra_args.append(f"--client_ttl={client_ttl}")
        if lease_ttl_ms is not None:
            self.extra_args.append(f"--default_kv_lease_ttl={lease_ttl_ms}")
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake_master-", suffix=".log", delete=False)

    @property
    def master(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    def tier_config(self, medium: str = "dram_pool", segment: str = "64MiB", **extra: Any) -> dict[str, Any]:
        """A tier config for this master (``medium`` included), loopback and ``tcp``."""
        cfg = {"medium": medium, "backend": "mooncake", "master": self.master,
               "metadata_server": self.metadata_server, "protocol": "tcp", "segment": segment,
               "local_hostname": HOST}
        if medium == "remote_npu":
            cfg.pop("backend")
        cfg.update(extra)
        return cfg

    @property
    def master_http(self) -> str:
        """The master's HTTP endpoint (metrics, segment list)."""
        return f"{HOST}:{self.metrics_port}"

    def standalone_pool(self, segment: str = "256MiB", **kwargs: Any):
        """A ``StandalonePool`` (a ``mooncake_client`` owning the pool memory) for this master, not started."""
        from tierkv.tiers.remote.standalone import StandalonePool

        return StandalonePool(self.master, self.metadata_server, segment, host=HOST, master_http=self.master_http,
                              **kwargs)

    def start(self) -> "MooncakeMaster":
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [self.binary, f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
               "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
               f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}", *self.extra_args]
        env = dict(os.environ, GLOG_minloglevel="2")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     start_new_session=True)
        if not (wait_port(self.rpc_port, 15) and wait_port(self.http_port, 15)):
            self.stop()
            raise RuntimeError(f"mooncake_master did not open ports {self.rpc_port}/{self.http_port}; "
                               f"log: {self.log_tail()}")
        return self

    def kill(self) -> None:
        """Crash the master (SIGKILL): every object it knew is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> "MooncakeMaster":
        self.kill()
        # the ports were ours a moment ago; wait until the kernel lets them go
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                return self.start()
            except RuntimeError:
                time.sleep(0.2)
        return self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self._log.name, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


@pytest.fixture
def mooncake_master():
    """A fresh master for one test, stopped afterwards."""
    with MooncakeMaster() as m:
        yield m


@pytest.fixture(scope="module")
def shared_mooncake_master():
    """One master for a whole test module (tests must use distinct keys)."""
    with MooncakeMaster() as m:
        yield m


class Holder:
    """A child process that does its work, prints one line, then holds (its pool segment) until its stdin closes.

    ``with Holder(args) as h: h.line`` is that first line ("" when the child died first); leaving the
    block closes its stdin and waits for it to exit (killed after ``wait_s``).
    """

    def __init__(self, args: list[str], wait_s: float = 30.0, **popen: Any) -> None:
        self.args, self.wait_s, self.popen = args, wait_s, popen
        self.proc: subprocess.Popen | None = None
        self.line = ""

    def __enter__(self) -> Holder:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     **self.popen)
        try:
            self.line = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        if p.stdin:
            p.stdin.close()
        try:
            p.wait(self.wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
