"""``benchmark.py compile-memory``'s measuring process: argv MODEL ROUNDS; prints ``RESULT <round> <resident GB>``
(round 0: before any model), each round a model of another width predicting one structure, then freed."""

import gc
import sys

from orb.device import configure_mindspore, recycle_compiled_memory, release_host_memory, resident_gb

configure_mindspore("CPU")
from ase.build import bulk  # noqa: E402

from orb.inference.calculator import ORBCalculator  # noqa: E402
from orb.models import create  # noqa: E402

name, rounds = sys.argv[1], int(sys.argv[2])


def model_of_round(k: int):
    """A model whose graph no other round shares: one width more each round."""
    if name == "small":  # the tests' 2-layer orb-v2
        return create("orb_v2", seed=k, latent_dim=16 + 8 * k, mlp_hidden_dim=64, num_message_passing_steps=2,
                      head_mlp_hidden_dim=32)
    return create(name, seed=k, mlp_hidden_dim=1024 + 64 * k)


print("RESULT 0", round(resident_gb(), 3), flush=True)
for k in range(1, rounds + 1):
    model = model_of_round(k)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    atoms.calc = ORBCalculator(model)
    atoms.get_potential_energy()
    del atoms, model
    gc.collect()
    recycle_compiled_memory()
    release_host_memory()
    print(f"RESULT {k}", round(resident_gb(), 3), flush=True)
