"""``python -m tierkv`` runs the ``tierkv`` command (``python -m tierkv.demo`` runs the demo alone)."""

from tierkv.cli import main

raise SystemExit(main())
