"""For ``benchmark.py restart``: one process of a calculator script, timing its start-up and first two calls
(a new geometry each) on a rattled Cu cell; prints one JSON line.

    python calculator_first_call.py CHECKPOINT ATOMS_REPEAT
"""

import json
import sys
import time

start = time.perf_counter()
from ase.build import bulk  # noqa: E402

from orb.inference.calculator import ORBCalculator  # noqa: E402

calc = ORBCalculator.from_checkpoint(sys.argv[1], device_target="CPU")
built = time.perf_counter()
atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(int(sys.argv[2]))
atoms.calc = calc
times = []
for seed in (1, 2):
    atoms.rattle(0.02, seed=seed)
    t = time.perf_counter()
    atoms.get_potential_energy()
    times.append(time.perf_counter() - t)
sources = list(calc.predictor.sources.values())
print(json.dumps({"startup": built - start, "first_call": times[0], "second_call": times[1], "sources": sources,
                  "atoms": len(atoms)}))
