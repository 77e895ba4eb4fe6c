"""PyTorch peer of ``benchmark.py model`` (run with ``--torch-python``: torch and orb-models -- 0.4.2 for orb_v2,
0.5.5 for orb-v3 -- nothing of the project): the model with random weights, ``--steps`` batches of 8 rows of
``--db``; median inference and training-step (Adam) times after one warm-up call, and the process's peak memory.
Prints one JSON line {"inference": s, "train": s, "peak_gb": GB}."""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--model", required=True, help="orb_v2 or an orb-v3 name")
    parser.add_argument("--db", required=True, help="ASE database of labelled structures")
    parser.add_argument("--steps", type=int, required=True, help="batches of 8 structures")
    args = parser.parse_args()

    import json
    import re
    import time

    import numpy as np
    import torch
    torch.set_num_threads(2)

    from torch_builders import orb_v2, orb_v2_graphs, orb_v3, orb_v3_graphs

    if args.model == "orb_v2":
        model = orb_v2()
        graphs = orb_v2_graphs(args.db, args.steps)
    else:
        model, sc, extra = orb_v3(args.model)
        graphs = orb_v3_graphs(args.db, args.steps, sc, extra)
    from orb_models.forcefield.base import batch_graphs

    conservative = "conservative" in args.model
    batches = [batch_graphs(graphs[i:i + 8]) for i in range(0, len(graphs), 8)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    out = {}

    def timed(fn):
        fn(batches[0])
        ts = []
        for b in batches:
            t = time.perf_counter()
            fn(b)
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    def predict(b):
        if conservative:  # forces are derivatives: autograd stays on
            model.predict(b)
        else:
            with torch.no_grad():
                model.predict(b)

    def step(b):
        opt.zero_grad()
        loss = model.loss(b).loss
        loss.backward()
        opt.step()

    model.eval()
    out["inference"] = timed(predict)
    model.train()
    out["train"] = timed(step)
    out["peak_gb"] = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1e6
    print(json.dumps(out))


if __name__ == "__main__":
    main()
