"""``python -m bladed.runner``."""

from bladed.runner.main import main

raise SystemExit(main())
