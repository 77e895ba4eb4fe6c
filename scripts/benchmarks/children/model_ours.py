"""One measurement of ``benchmark.py model`` in a fresh process (its own peak memory; the operator profile is the
caller's ORB_OPS_PROFILE): model ``name`` on ``steps`` batches of 8 demo structures, padded to one bucket. Prints one
JSON line: median inference and training-step times, first-call (compile) times, sizes, the forward pass's
matrix-multiply work, peak memory and what each stage added to the resident memory."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # scripts/

import numpy as np  # noqa: E402

from benchmarks.common import peak_memory_gb, resident_gb  # noqa: E402 -- also puts the checkout on the path
from benchmarks.model import Setup  # noqa: E402


def measure_ours(name: str, steps: int) -> dict:
    """Median inference and training-step times (and first-call compile times) of model ``name`` on
    batches of 8 demo structures, all padded to one bucket (one compilation per step kind)."""
    memory = {}
    setup = Setup(name, steps, memory)
    out = {"atoms": setup.atoms, "edges": setup.edges, "bucket": list(setup.bucket),
           "forward_gflop": setup.forward_gflop()}
    for kind in setup.steps:
        times = [setup.run(kind, i) for i in range(steps)]
        out[kind], out[kind + "_compile"] = float(np.median(times[1:])), times[0]
        memory[f"{kind} graph and activations"] = resident_gb()
    out["peak_gb"] = peak_memory_gb()
    stages = list(memory.items())  # resident memory after each stage -> what each stage added
    out["memory_gb"] = {k: v - (stages[i - 1][1] if i else 0.0) for i, (k, v) in enumerate(stages)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("name", help="orb_v2 or an orb-v3 name (orb.models.MODEL_NAMES)")
    parser.add_argument("steps", type=int, help="batches of 8 demo structures")
    args = parser.parse_args()
    print(json.dumps(measure_ours(args.name, args.steps)))


if __name__ == "__main__":
    main()
