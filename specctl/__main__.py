"""``python -m specctl``: the command line without an installed entry point (a checkout on a bare machine)."""

import sys

from specctl.cli import main

sys.exit(main())
