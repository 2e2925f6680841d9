"""``python -m bladed.server [--config PATH] [--state-dir DIR]``."""

import sys

from bladed.server.daemon import main

sys.exit(main())
