"""``python -m bladed.runner``."""

from bladed.runner.cli import main

raise SystemExit(main())
