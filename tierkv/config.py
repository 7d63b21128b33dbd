"""Store configuration: a dict, or a JSON / YAML / TOML file holding one.

Shape::

    {
      "tiers": [                                   # fastest first
        {"medium": "hbm",  "device": "cpu", "capacity": "256MiB"},
        {"medium": "dram", "capacity": "2GiB", "eviction": "lru"},
        {"medium": "ssd",  "path": "/var/cache/tierkv", "capacity": "50GiB",
         "compression": "lz4", "admission": {"policy": "frequency", "min_accesses": 2}}
      ],
      "promotion": {"policy": "on-hit", "min_hits": 2},
      "io_workers": 4,
      "miss_memory": 65536,                        # recent departures remembered to explain misses
      "trace_path": "/var/log/tierkv/trace",       # optional: hash-only request traces (tierkv.trace)
      "trace": {"max_bytes": "64MiB", "max_files": 8},
      "shadow": {"rate": 0.05},                    # optional: what more capacity would buy (tierkv.shadow)
      "verify": "external",                        # optional: every tier's default 'verify'
      "tenants": {"alice": {"dram": {"share": 0.5}}}  # optional: quotas per tenant per tier (tierkv.tenants)
    }

Keys every tier takes: ``medium`` (a built-in name or ``"package.module:Class"``),
``name`` (defaults to the medium; must be unique), ``eviction`` (managed media),
``admission``, ``persist`` (``"write_behind"``: every chunk stored above is copied
in by a background queue, the default for persistent media; ``"write_through"``:
copied in synchronously; ``"on_evict"``: only demotions, the default otherwise; a
``tierkv.persist.PersistMode``), ``verify`` (when reads are checked against each chunk's checksum:
``"external"``, the default, checks every read from a tier whose bytes can change outside this process
(pooled, remote, disk); ``"always"`` checks local tiers (``hbm``, ``dram``) too; the store's top-level
``verify`` sets every tier's default; ``tierkv.checksum.Verify``).  Everything else goes to the medium, which rejects what it
does not know.  Unknown keys are errors, never ignored; a removed spelling (``"write_through": true``,
``"eviction": "s3-fifo"``, ``"promotion": "on_hit"``, admission ``"threshold"``) is an error naming
the one to use.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

from tierkv.checksum import parse_verify
from tierkv.engine.level import Level
from tierkv.errors import ConfigError
from tierkv.options import check_int, check_str
from tierkv.persist import pop_persist
from tierkv.tiers import medium_class

TOP_KEYS = {"tiers", "promotion", "io_workers", "write_behind_queue", "miss_memory",
            "trace_path", "trace", "shadow",  # these three: tierkv.config_observers
            "verify", "tenants"}


def default_config(root: str | None = None) -> dict[str, Any]:
    """The embedded defaults: a small HBM(cpu) → DRAM → SSD chain under ``root``."""
    root = root or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tierkv")
    return {
        "tiers": [
            {"medium": "hbm", "device": "cpu", "capacity": "64MiB"},
            {"medium": "dram", "capacity": "256MiB", "eviction": "lru"},
            {"medium": "ssd", "path": os.path.join(root, "ssd"), "capacity": "2GiB", "compression": "none"},
        ],
        "promotion": {"policy": "on-hit", "min_hits": 1},
    }


def load_config(config: Any) -> dict[str, Any]:
    """Read and check the top level of a config (dict or file path); returns a fresh dict."""
    if isinstance(config, (str, os.PathLike)):
        cfg = _read_file(os.fspath(config))
    elif isinstance(config, dict):
        cfg = copy.copy(config)
    else:
        raise ConfigError(f"config must be a dict or a file path, got {type(config).__name__}")
    if not isinstance(cfg, dict):
        raise ConfigError("config must be a mapping at the top level")
    unknown = set(cfg) - TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(unknown)}; known: {sorted(TOP_KEYS)}")
    if "io_workers" in cfg:
        check_int(cfg["io_workers"], "config key 'io_workers'", min_value=1, max_value=256)
    if "write_behind_queue" in cfg:
        check_int(cfg["write_behind_queue"], "config key 'write_behind_queue'", min_value=0)
    if "miss_memory" in cfg:
        check_int(cfg["miss_memory"], "config key 'miss_memory'", min_value=0)
    tiers = cfg.get("tiers")
    if not isinstance(tiers, list) or not tiers:
        raise ConfigError("config needs 'tiers': a non-empty list of tier configs, fastest first")
    return cfg


def _read_file(path: str) -> Any:
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    try:
        if ext == ".json":
            return json.loads(raw)
        if ext in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as e:
                raise ConfigError(f"config file {path} is YAML but PyYAML is not installed (pip install pyyaml)") from e
            return yaml.safe_load(raw)
        if ext == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # the backport, a dependency on Python 3.10
                import tomli as tomllib

            return tomllib.loads(raw.decode())
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"cannot parse config file {path}: {e}") from e
    raise ConfigError(f"config file {path}: unknown extension {ext!r} (use .json, .yaml, .yml or .toml)")


def build_levels(tier_cfgs: list[Any], verify: Any = None) -> list[Level]:
    """Instantiate every tier of the chain (``verify``: every tier's default); on any error, release those
    already built."""
    default_verify = parse_verify(verify, "config") if verify is not None else None
    levels: list = []
    names: set[str] = set()
    try:
        for pos, raw in enumerate(tier_cfgs):
            if not isinstance(raw, dict):
                raise ConfigError(f"tiers[{pos}] must be a mapping, got {raw!r}")
            opts = dict(raw)
            medium = opts.pop("medium", None)
            if medium is None:
                raise ConfigError(f"tiers[{pos}] lacks 'medium' (e.g. 'hbm', 'dram', 'ssd', 'dram_pool')")
            cls = medium_class(medium)
            name = opts.pop("name", None)
            name = check_str(name, f"tiers[{pos}] option 'name'") if name is not None else (cls.medium or str(medium))
            if name in names:
                raise ConfigError(f"tiers[{pos}]: tier name {name!r} is used twice; give one a 'name'")
            names.add(name)
            eviction = opts.pop("eviction", None)
            admission = opts.pop("admission", None)
            persist = pop_persist(opts, f"tier {name!r}")
            raw_verify = opts.pop("verify", None)
            verify = parse_verify(raw_verify, f"tier {name!r}") if raw_verify is not None else default_verify
            for key, path in ((k, v) for k, v in opts.items() if k in ("path", "root")):
                if any(getattr(lvl.tier, "path", None) == os.path.abspath(os.path.expanduser(str(path))) for lvl in levels):
                    raise ConfigError(f"tiers[{pos}]: {key} {path!r} is used by another tier of this store")
            tier = cls.from_config(name, opts)
            try:
                levels.append(Level(tier, eviction=eviction, admission=admission, persist=persist, verify=verify))
            except Exception:
                tier.close()
                raise
    except Exception:
        for lvl in levels:
            lvl.tier.close()
        raise
    return levels
