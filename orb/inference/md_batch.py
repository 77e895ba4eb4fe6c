"""orb-md's batching: each structure's ASE integrator runs in a thread of its own, and whenever one asks for forces its
request waits until every running structure has asked; one padded, compiled model call answers them all."""

import threading
from typing import Dict


class StopRun(Exception):
    """Ends a structure's dynamics: a stop signal (its state saved), or its uncertainty."""


class StructureFailed(Exception):
    """The model could not compute this structure (e.g. atoms on top of each other)."""


class BatchServer:
    """Force requests of many structures' integrators (threads) answered together: :meth:`request` waits until every
    running structure has asked, or finished, then one call of ``evaluate`` answers all of them."""

    def __init__(self, evaluate):
        self.evaluate = evaluate  # {key: atoms} -> {key: results dict or an exception}
        self.condition = threading.Condition()
        self.pending: Dict[int, object] = {}
        self.answers: Dict[int, object] = {}
        self.running = 0
        self.calls = 0

    def join(self) -> None:
        with self.condition:
            self.running += 1

    def leave(self) -> None:
        with self.condition:
            self.running -= 1
            self.condition.notify_all()

    def request(self, key: int, atoms):
        """(From a structure's thread) this structure's results at ``atoms``, computed with the others'."""
        with self.condition:
            self.pending[key] = atoms
            self.condition.notify_all()
            while key not in self.answers:
                self.condition.wait()
            answer = self.answers.pop(key)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def serve(self, done, at_step=lambda: None) -> None:
        """(From the main thread) answer batches until ``done()``: all threads have left. ``at_step()`` runs while
        every structure of a batch waits for its answer, so what it decides (a stop) every structure sees after the
        same step."""
        while True:
            with self.condition:
                while not (self.running and len(self.pending) == self.running) and not done():
                    self.condition.wait(timeout=0.5)
                if done() and not self.pending:
                    return
                batch, self.pending = self.pending, {}
            at_step()
            answers = self.evaluate(batch)
            self.calls += 1
            with self.condition:
                self.answers.update(answers)
                self.condition.notify_all()


def make_calculator_class():
    from ase.calculators.calculator import Calculator, all_changes

    class ServedCalculator(Calculator):
        """An ASE calculator whose results come from the batch server (one structure's view of the batched model)."""

        implemented_properties = ["energy", "free_energy", "forces", "stress", "force_error"]

        def __init__(self, server: BatchServer, key: int):
            super().__init__()
            self.server, self.key = server, key

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            self.results = dict(self.server.request(self.key, self.atoms.copy()))

    return ServedCalculator
