"""``dynamic-shape``: the calculator's one prediction graph for structures of every size (MindSpore's dynamic-shape
inputs) against a graph per padded shape (orb-md's), in each operator profile: the first compilation, each new size's
first call, the median call, and how far the predictions differ from the first mode's (see
``children/dynamic_shape.py``)."""

import json
import os
import subprocess
import sys

import numpy as np

from .common import HERE, ROOT

CHILD = os.path.join(HERE, "children", "dynamic_shape.py")
MODES = (("per-shape", "cpu"), ("every-size", "cpu"), ("per-shape", "portable"), ("every-size", "portable"))
SIZES = ("32", "64", "256")


def run_child(mode: str, profile: str, model: str):
    """The child's results, or the last line of its error (a mode MindSpore cannot run)."""
    result = subprocess.run([sys.executable, CHILD, mode, profile, model], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT, ORB_COMPILE_CACHE="0"))
    found = [line[7:] for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if found:
        return json.loads(found[0])
    lines = [line for line in result.stderr.splitlines() if "Error" in line] or result.stderr.strip().splitlines()
    return (lines[-1] if lines else "failed")[:160]


def bench_dynamic_shape(args) -> None:
    """``--rounds`` alternations of the modes (no compile cache), a table row per mode and round."""
    rows, reference = [], None
    for k in range(args.rounds):
        for mode, profile in MODES:
            found = run_child(mode, profile, args.model)
            label = f"{mode}, {profile}"
            if isinstance(found, str):
                rows.append(f"| {label} | {k + 1} | fails: {found} |" + " |" * (len(SIZES) + 1))
                continue
            reference = reference or found  # the first: per-shape, cpu
            cells = [f"{found[s]['first']:.2f} s, {found[s]['median'] * 1000:.0f} ms" for s in SIZES]
            energy = max(abs(found[s]["energy"] - reference[s]["energy"]) / int(s) for s in SIZES)
            forces = max(np.abs(np.array(found[s]["forces"]) - np.array(reference[s]["forces"])).max()
                         for s in SIZES)
            rows.append(f"| {label} | {k + 1} | {found['first']:.2f} s | " + " | ".join(cells) +
                        f" | {energy:.1e}, {forces:.1e} |")
    print(f"{args.model}: first compilation; each size's first call and median call (rattled Cu, a new geometry each "
          "call); largest difference from per-shape, cpu of round 1 (eV/atom, eV/Å)\n")
    print("| graph, profile | round | first | " + " | ".join(f"{s} atoms" for s in SIZES) + " | difference |")
    print("|---|---|---|" + "---|" * len(SIZES) + "---|")
    print("\n".join(rows))
