"""``python -m lightning_aesgd.bench``."""

import sys

from lightning_aesgd.bench.cli import main

if __name__ == "__main__":  # a process spawned by a benchmark imports this module too
    sys.exit(main())
