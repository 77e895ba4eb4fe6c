"""Check the physics of a fine-tuned model against its foundation: lattice, equation of state, elastic constants and
phonons (see orb/inference/properties.py); installed as the console command orb-properties too."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # (before the command's imports start threads: orb.signals.program_starts)
    from orb.signals import program_starts

    program_starts()
from orb.inference.properties import main  # noqa: E402

if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
