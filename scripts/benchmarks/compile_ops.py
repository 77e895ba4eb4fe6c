"""``compile-ops``: what graph compilation costs per operation written in a ``construct`` and per part of a model
(no compile cache, a fresh process per round): why the models read a tensor's components with one ``Unstack``
rather than by indexing."""

import os
import subprocess
import sys

from benchmarks.common import HERE, ROOT

CHILD = os.path.join(HERE, "children", "compile_ops.py")
OPS = ("y * 1.5; ops.abs(y); ops.gather(y, idx, 0); y.reshape(-1, 3); y.astype(ms.float64).astype(ms.float32); "
       "ops.stack(ops.unstack(y, 1), 1); ops.stack((y[:, 0], y[:, 1], y[:, 2]), 1); y[:, 0:3] * 1.0; "
       "ops.concat(ops.split(y, 1, axis=1), 1); y.sum(1).reshape(-1, 1) + y; ops.norm(y, dim=1).reshape(-1, 1) * y")


def bench_compile_ops(args) -> None:
    """Two tables: milliseconds of compilation per use of each expression, and seconds per model part; each
    round's figures side by side."""
    ops_rows, part_rows = {}, {}
    for _ in range(args.rounds):
        result = subprocess.run([sys.executable, CHILD], cwd=ROOT, capture_output=True, text=True,
                                env=dict(os.environ, PYTHONPATH=ROOT, ORB_BENCH_OPS=args.ops,
                                         ORB_BENCH_MODEL=args.model))
        if result.returncode:
            raise SystemExit(f"compile-ops: the measuring process failed:\n{result.stderr[-3000:]}")
        for line in result.stdout.splitlines():
            if line.startswith("RESULT "):
                _, kind, value, name = line.split(" ", 3)
                (ops_rows if kind == "op" else part_rows).setdefault(name, []).append(value)
    print("| expression (each use) | compile (ms), each round |\n|---|---|")
    for name, values in ops_rows.items():
        print(f"| `{name}` | {', '.join(values)} |")
    if part_rows:
        print(f"\n| part of {args.model} (1 layer, 32 wide) | compile (s), each round |\n|---|---|")
        for name, values in part_rows.items():
            print(f"| {name} | {', '.join(values)} |")
