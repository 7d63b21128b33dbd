"""Operator tools over the store: the ``tierkv`` command (``cli``), the trace simulator (``sim``),
benchmark suites, demos, the Prometheus exporter (``metrics``), request traces (``trace``) and
read-only inspection (``inspect``).

Tools may import every other layer (foundations, the store engine, media, policies and,
inside a function, the vLLM adapter).  No foundation, engine, medium or policy module
imports a tool: the store reaches the tracer a config turns on through ``tierkv.plugins``.
The vLLM adapter uses the exporter and the trace writer.  ``tests/test_layers.py`` checks it.
"""
