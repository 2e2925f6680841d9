"""``python -m bladed.server [--config PATH] [--state-dir DIR]``."""

import sys

from bladed.server.main import main

sys.exit(main())
