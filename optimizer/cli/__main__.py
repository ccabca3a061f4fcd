"""``python -m optimizer.cli``: the same as ``dsopt``."""

import sys

from optimizer.cli import main

sys.exit(main())
