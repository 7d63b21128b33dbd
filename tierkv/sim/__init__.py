"""The trace simulator: request traces replayed through the real store over payload-free media.

``traces`` reads and writes trace files, ``generate`` makes synthetic workloads,
``replay`` runs a trace through ``TieredStore`` over ``NullTier`` media, ``sweep``
varies a tier's capacity and eviction policy and plots the curves.
"""

from .generate import KINDS, generate
from .replay import DEFAULT_BYTES_PER_TOKEN, SimResult, null_store, replay, simulate
from .sweep import parse_sweep, plot, sweep, write_csv
from .traces import FORMATS, Request, read_trace, summarize, write_trace

__all__ = ["Request", "read_trace", "write_trace", "summarize", "FORMATS", "generate", "KINDS",
           "null_store", "replay", "simulate", "SimResult", "DEFAULT_BYTES_PER_TOKEN",
           "parse_sweep", "sweep", "plot", "write_csv"]
