"""``python -m optimizer.cli``: the same as ``dsopt``."""

import sys

from optimizer.cli import entry

sys.exit(entry())
