"""Relax every structure of a data set with FIRE, many per compiled call (see orb/inference/relax.py); installed as
the console command orb-relax too."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # (before the command's imports start threads: orb.signals.program_starts)
    from orb.signals import program_starts

    program_starts()
from orb.inference.relax import main  # noqa: E402

if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
