"""The trace simulator: request traces replayed through the real store over payload-free media.

``traces`` reads and writes trace files, ``generate`` makes synthetic workloads,
``replay`` runs a trace through ``TieredStore`` over ``NullTier`` media, ``sweep``
varies a tier's capacity and eviction policy and plots the curves.
"""

from .generate import KINDS, generate
from .replay import DEFAULT_BYTES_PER_TOKEN, SimResult, null_store, replay, simulate
from .sweep import parse_sweep, plot, sweep, write_csv
from .traces import FORMATS, Request, read_trace, summarize, write_trace

__all__ = [
           "DEFAULT_BYTES_PER_TOKEN",
           "FORMATS",
           "KINDS",
           "Request",
           "SimResult",
           "generate",
           "null_store",
           "parse_sweep",
           "plot",
           "read_trace",
           "replay",
           "simulate",
           "summarize",
           "sweep",
           "write_csv",
           "write_trace",
]
