"""Operator tools over the store: the ``tierkv`` command (``cli``), the trace simulator (``sim``),
benchmark suites, demos, live inspection of a running deployment (``live``) and read-only
inspection of a store's files (``inspect``).

Tools sit on top: they may import every other layer (contracts, the core store, media,
policies and, inside a function, the engine adapters), and nothing below imports a tool.
The Prometheus exporter (``tierkv.metrics``) and the request-trace writer (``tierkv.trace``)
that the tools and the adapters share live in the core.  ``tests/test_import_direction.py``
checks the direction.
"""
