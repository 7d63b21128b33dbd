"""``python -m tierkv`` runs the demo."""

from tierkv.demo import main

raise SystemExit(main())
