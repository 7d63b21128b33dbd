"""``python -m tierkv`` runs the ``tierkv`` command (``python -m tierkv.tools.demo`` runs the demo alone)."""

from tierkv.tools.cli import main

raise SystemExit(main())
