"""Operator tools over the store: the ``tierkv`` command (``cli``), the trace simulator (``sim``),
benchmark suites, demos, the Prometheus exporter (``metrics``), request traces (``trace``) and
read-only inspection (``inspect``).

Tools may import every other layer (foundations, the store engine, media, policies and,
inside a function, the vLLM adapter); nothing outside ``tierkv.tools`` imports a tool,
save ``python -m tierkv`` (``tierkv.__main__``).  ``tests/test_layers.py`` checks both.
"""
