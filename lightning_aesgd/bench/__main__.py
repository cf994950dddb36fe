"""``python -m lightning_aesgd.bench``."""

import sys

from lightning_aesgd.bench.cli import main

sys.exit(main())
