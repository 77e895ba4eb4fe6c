"""``benchmark.py call-memory``'s measuring process: argv MODEL CHECKPOINT PRECISION N; prints ``RESULT <peak GB>
<median call s>`` after three calls on rattled Cu fcc cells of 4 N^3 atoms. N 0: writes the model's random weights to
CHECKPOINT instead (a process of its own: what building and saving the model leaves is no call's memory)."""

import sys
import time

import numpy as np

from orb.device import configure_mindspore

name, path, precision, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
configure_mindspore("CPU")
from ase.build import bulk  # noqa: E402

from orb.inference.calculator import ORBCalculator  # noqa: E402

if n == 0:
    from orb.io.checkpoint import save_checkpoint
    from orb.models import create

    save_checkpoint(path, create(name))
    sys.exit(0)
calculator = ORBCalculator.from_checkpoint(path, precision=precision, device_target="CPU", model_name=name)
atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n, n, n))
rng = np.random.default_rng(0)
seconds = []
for _ in range(3):
    cell = atoms.copy()
    cell.positions += rng.normal(0, 0.02, cell.positions.shape)
    cell.calc = calculator
    start = time.perf_counter()
    cell.get_forces()
    seconds.append(time.perf_counter() - start)
with open("/proc/self/status") as status:
    peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
print("RESULT", round(peak_kb / 2 ** 20, 3), round(float(np.median(seconds)), 3), flush=True)
