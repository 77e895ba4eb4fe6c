"""``compile-options``: MindSpore's compile options (``mindspore.graph._parse.compile_config``) on one compilation of
a training step (orb-v2's or ``--name``'s; full, or the tests' 2-layer one: ``--model small``), each in a fresh
process, the options alternated round by round."""

import os
import subprocess
import sys

from benchmarks.common import HERE, ROOT

CHILD = os.path.join(HERE, "children", "compile_options.py")


def bench_compile_options(args) -> None:
    """A table of the compile time with each option (and none); with ``COMPILE_PROFILE=1`` among them, the phases of
    its last compilation that took over 5 % (MindSpore's own profile)."""
    options = [""] + [o.strip() for o in args.options.split(",") if o.strip()]
    seconds, phases = {option: [] for option in options}, []
    for _ in range(args.rounds):
        for option in options:
            result = subprocess.run([sys.executable, CHILD, *([option] if option else [])], cwd=ROOT,
                                    capture_output=True, text=True,
                                    env=dict(os.environ, PYTHONPATH=ROOT, ORB_BENCH_MODEL=args.model,
                                             ORB_BENCH_NAME=args.name))
            found = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESULT ")]
            seconds[option].append(f"{float(found[0][0]):.2f} (loss {found[0][2]})" if found else "does not compile")
            if option.startswith("COMPILE_PROFILE"):
                phases = [line.strip() for line in result.stdout.splitlines()
                          if line.strip().endswith("%") and ":" in line and float(line.split(":")[-1][:-1]) > 5.0]
    print("| option | compile (s), each round |\n|---|---|")
    for option in options:
        print(f"| {option or 'none'} | {', '.join(seconds[option])} |")
    if phases:
        print("\nCOMPILE_PROFILE's phases over 5 % of the compilation:\n" + "\n".join(phases))
