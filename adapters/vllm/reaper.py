"""Watches a worker process from outside its process tree (started by lifecycle.py).

Run as ``python -I -S reaper.py WORKER_PID`` with a pipe on stdin.  It forks,
the parent exits at once (the worker reaps it) and the child, now an orphan in
a session of its own, is beyond vLLM's kill of the engine's process tree and
its process group.  It reads JSON lines ``[kind, worker id, payload]``:

* ``start`` (payload ``{"sockets": [path, ...]}``): a worker began, serving on these sockets;
* ``totals`` (payload: the worker's reduced totals): its latest counters;
* ``logged``: the worker printed its totals line itself (its shutdown began);
* ``clean``: that worker shut down its connector itself.

At end of input (the worker process ended, however: the kernel closes the
pipe) it prints the totals line of every worker that neither shut down nor
printed it, removes any file socket they left, and exits.  It uses the standard
library only, writes no file and holds nothing else open.
"""

from __future__ import annotations

import json
import os
import sys


def _main(worker_pid: str) -> None:
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    workers: dict[str, dict] = {}
    for raw in sys.stdin.buffer:
        try:
            kind, ident, payload = json.loads(raw)
        except ValueError:
            continue
        if kind == "start":
            workers[ident] = {"sockets": (payload or {}).get("sockets") or [], "totals": None, "logged": False}
        elif kind == "totals" and ident in workers:
            workers[ident]["totals"] = payload
        elif kind == "logged" and ident in workers:
            workers[ident]["logged"] = True
        elif kind == "clean":
            workers.pop(ident, None)
    for ident, w in workers.items():
        for path in w["sockets"]:
            if path and not path.startswith("\0"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if w["logged"]:
            continue
        totals = w["totals"] or {}
        sys.stdout.write(f"TierKVConnector totals: {totals} (worker {ident}, pid {worker_pid}, ended before "
                         "its connector shut down)\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _main(sys.argv[1])
