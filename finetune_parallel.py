"""Data-parallel fine-tuning, one process per device, launched by msrun (see run_parallel.sh)."""

import sys

from orb.training.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], parallel=True))
