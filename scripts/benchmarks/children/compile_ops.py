"""What graph compilation costs per operation and per part of a model (``benchmark.py compile-ops``), no compile
cache. Prints ``RESULT op <ms per use> <expression>`` for each expression of ``ORB_BENCH_OPS`` (``;``-separated: each
written REPEATS times in one ``construct`` on a (50, 3) float32 tensor ``y``, less the compilation of ``y`` alone,
over REPEATS) and ``RESULT part <s> <name>`` for each part of a 1-layer, 32-wide ``ORB_BENCH_MODEL`` (random
weights), compiled from the model inputs of 4 demo structures in the order of PARTS."""

import importlib.util
import os
import sys
import tempfile
import time

import numpy as np

from orb.device import configure_mindspore

configure_mindspore("CPU")

REPEATS = 20
INPUTS = ("numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell, unit_shifts, "
          "charge, spin, head")
PARTS = {  # name -> the body of a construct(self, *INPUTS) whose self.m is the model
    "backbone": "return self.m.model.construct(*BACKBONE)",
    "net torque removal": "return remove_net_torque(positions * 2.0, positions, node_graph, n_node, nonperiodic)",
    "stress from a virial": "return voigt(per_volume(cell * 2.0, cell, signed=False))",
    "model outputs": f"return self.m({INPUTS})",
    "predictions": f"return self.m.predictions({INPUTS})",
}
BACKBONE = {"orb_v2": "numbers, vectors, senders, receivers",
            "orb_v3": "numbers, vectors, senders, receivers, node_graph, charge, spin"}
HEADER = ("import mindspore as ms\nfrom mindspore import nn, ops\nfrom orb.models.gns import remove_net_torque\n"
          "from orb.models.repulsion import per_volume, voigt\n")


def compiled_seconds(folder: str, source: str, cell_args: tuple, inputs: tuple) -> float:
    """Compile time of the cell ``Z(*cell_args)`` that ``source`` defines (written to a file: MindSpore parses the
    source of ``construct``) on ``inputs``."""
    path = os.path.join(folder, f"cell{len(os.listdir(folder))}.py")
    with open(path, "w") as f:
        f.write(HEADER + source)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (MindSpore's parser imports a construct's module by name)
    spec.loader.exec_module(module)
    cell = module.Z(*cell_args)
    start = time.perf_counter()
    cell.compile(*inputs)
    return time.perf_counter() - start


def op_seconds(folder: str, body: str) -> float:
    from mindspore import Tensor

    source = ("class Z(nn.Cell):\n    def construct(self, x, idx):\n        y = x\n" + f"        y = {body}\n" * REPEATS
              + "        return y\n")
    return compiled_seconds(folder, source, (), (Tensor(np.random.rand(50, 3).astype(np.float32)),
                                                 Tensor(np.zeros(50, np.int32))))


def part_seconds(folder: str, model, body: str, inputs) -> float:
    body = body.replace("*BACKBONE", BACKBONE[model.cfg.family])
    source = ("class Z(nn.Cell):\n    def __init__(self, m):\n        super().__init__(auto_prefix=False)\n"
              f"        self.m = m\n    def construct(self, {INPUTS}):\n        {body}\n")
    return compiled_seconds(folder, source, (model,), inputs)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        op_seconds(folder, "y")  # (the process's first compilation also pays MindSpore's start)
        baseline = op_seconds(folder, "y")
        for body in [b.strip() for b in os.environ.get("ORB_BENCH_OPS", "").split(";") if b.strip()]:
            print(f"RESULT op {1000.0 * (op_seconds(folder, body) - baseline) / REPEATS:.1f} {body}", flush=True)
        name = os.environ.get("ORB_BENCH_MODEL", "")
        if not name:
            return
        from orb import smoke_test
        from orb.data.batching import batch_graphs, pad_batch
        from orb.data.dataset import AseDbDataset
        from orb.data.tensors import model_inputs
        from orb.models import create

        model = create(name, latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=1, head_mlp_hidden_dim=32)
        data = AseDbDataset(smoke_test.DEMO, settings=model.cfg.graph_settings())
        batch = batch_graphs([data[i] for i in range(4)])
        inputs = model_inputs(pad_batch(batch, batch.num_nodes + 1, batch.num_edges, batch.num_graphs + 1))
        for part, body in PARTS.items():
            print(f"RESULT part {part_seconds(folder, model, body, inputs):.2f} {part}", flush=True)


if __name__ == "__main__":
    main()
