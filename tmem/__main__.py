"""``python -m tmem`` runs the command line."""

from tmem.cli import main

raise SystemExit(main())
