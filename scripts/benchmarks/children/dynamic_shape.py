"""One process of ``dynamic-shape``: argv ``per-shape|every-size cpu|portable MODEL`` (a model name, random weights,
or ``demo``, the demo checkpoint). Rattled copper cells of 32, 64 and 256 atoms, each call a new geometry: prints
``RESULT <json>`` with the first compilation, each size's first call and median call, and the energies and forces of
fixed geometries (for the parent to compare the modes).

``per-shape``: a graph per padded shape (orb-md's; the calculator's for a shape met more than ``OWN_GRAPH_AFTER``
times, and on devices without the graph for every size). ``every-size``: the calculator's graph for structures of
every size (:func:`orb.inference.predictor.one_graph_for_every_size`), kept for every call here."""

import json
import os
import sys
import time

import numpy as np

mode, profile, name = sys.argv[1:4]
from orb.device import configure_mindspore, set_ops_profile  # noqa: E402

configure_mindspore("CPU")
set_ops_profile(profile)

from ase.build import bulk  # noqa: E402

from orb.data.batching import batch_graphs  # noqa: E402
from orb.data.graphs import atoms_to_graph  # noqa: E402
from orb.inference import predictor as predictors  # noqa: E402
from orb.io.checkpoint import model_from_checkpoint  # noqa: E402
from orb.models import create  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
model = (model_from_checkpoint(os.path.join(ROOT, "data", "demo_pretrained.ckpt"), None) if name == "demo"
         else create(name, seed=0))
predictors.OWN_GRAPH_AFTER = 10 ** 9  # (every call through the graph for every size)
predictor = predictors.Predictor(model, reuse=mode == "every-size")
if mode == "every-size" and not predictor.every_size:
    raise SystemExit(f"Error: no graph for every size for {name} here")


def batch(reps, seed):
    atoms = bulk("Cu", cubic=True) * reps
    atoms.rattle(0.05, seed=seed)
    return batch_graphs([atoms_to_graph(atoms, settings=model.cfg.graph_settings())])


result = {}
start = time.perf_counter()
predictor(batch((2, 2, 2), 0))
result["first"] = time.perf_counter() - start
for reps, atoms in (((2, 2, 2), 32), ((2, 2, 4), 64), ((4, 4, 4), 256)):
    start = time.perf_counter()
    out = predictor(batch(reps, 1))  # (a shape new to the process compiles here, per shape)
    first = time.perf_counter() - start
    times = []
    for k in range(6):
        b = batch(reps, 10 + k)
        start = time.perf_counter()
        predictor(b)
        times.append(time.perf_counter() - start)
    result[str(atoms)] = dict(first=first, median=float(np.median(times)), energy=float(out["energy"][0]),
                              forces=out["forces"].tolist())
print("RESULT " + json.dumps(result))
