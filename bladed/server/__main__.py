"""``python -m bladed.server [--config PATH] [--state-dir DIR]``."""

import sys

from bladed.server.daemon.main import main

sys.exit(main())
