"""vLLM V1 KV connector for tierkv.

Use it from vLLM with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "tierkv.adapters.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"tierkv": {...store config...}}}'

The connector class is imported on first use, so the engine-free helpers in
``tierkv.adapters.vllm.config``, ``.chunks`` and ``.paged`` work without vLLM
installed.  See ``docs/vllm.md`` for the options and ``docs/vllm-shutdown.md`` for the shutdown behaviour.
"""

from __future__ import annotations

from typing import Any

from tierkv.lazy import load_export

_LAZY = {
    "TierKVConnector": "connector",
    "live_connectors": "connector",
    "TierKVScheduler": "scheduler",
    "TierKVWorker": "worker",
    "TierKVConnectorMetadata": "metadata",
    "LoadSpec": "metadata",
    "SaveSpec": "metadata",
    "TierKVConnectorStats": "connector_stats",
    "ConnectorOptions": "config",
    "EngineInfo": "config",
    "parse_options": "config",
    "ProbeRequest": "service",
    "ProbeAnswer": "service",
    "TierPlace": "service",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    return load_export(__name__, _LAZY, globals(), name)
