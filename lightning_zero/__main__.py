"""``python -m lightning_zero ...`` is ``lightning-zero ...``."""

import sys

from lightning_zero.cli import main

sys.exit(main())
