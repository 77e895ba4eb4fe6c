"""The installed commands (pyproject.toml's ``[project.scripts]``): each runs its module's ``main`` as the checkout's
scripts do (:func:`orb.signals.run_program`). Importing this imports nothing heavy; a command's module is imported
when it runs."""

from importlib import import_module
from typing import Callable

from orb.signals import program_starts, run_program


def program(module: str) -> Callable[[], None]:
    """The console entry point running ``module``'s ``main``."""

    def run() -> None:
        program_starts()
        run_program(import_module(module).main)

    run.module = module
    return run


finetune = program("orb.training.cli")
finetune_parallel = program("orb.training.launch")
evaluate = program("orb.inference.evaluate")
relax = program("orb.inference.relax")
export = program("orb.inference.export")
md = program("orb.inference.md")
properties = program("orb.inference.properties")
convert = program("orb.io.convert")
download = program("orb.io.download")
plot = program("orb.reports.curves")
smoke_test = program("orb.smoke_test")
