"""One compilation of a training step (orb-smoke-test's) with MindSpore's compile options set first (``NAME=VALUE``
arguments, ``mindspore.graph._parse.compile_config``): prints ``RESULT <compile s> <step s> <loss>``. The model: full
orb-v2 with the smoke test's weights, or ``ORB_BENCH_NAME``'s (random weights); ``ORB_BENCH_MODEL=small``: the tests'
2-layer, 32-wide one (random weights)."""

import os
import sys

from mindspore.graph._parse import compile_config

for option in sys.argv[1:]:
    name, value = option.split("=", 1)
    setattr(compile_config, name, value)

from orb.device import configure_mindspore  # noqa: E402  (after the options: the compiler reads them at its start)
from orb import smoke_test  # noqa: E402

configure_mindspore("CPU", precision="float32-highest")
model, name = None, os.environ.get("ORB_BENCH_NAME", "orb_v2")
if os.environ.get("ORB_BENCH_MODEL") == "small" or name != "orb_v2":
    from orb.models import create

    small = dict(latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2, head_mlp_hidden_dim=32)
    model = create(name, seed=0, **(small if os.environ.get("ORB_BENCH_MODEL") == "small" else {}))
params = None
if name != "orb_v2":  # what fine-tuning it trains (orb-v3: not the reference energies, nor the unused parts)
    from orb.training.config import config_from_dict
    from orb.training.engine import trainable_parameters

    params = trainable_parameters(model, config_from_dict(dict(model=dict(name=name))))
step = smoke_test.training_step("CPU", model, params)
print("RESULT", step["compile_s"], step["step_s"], repr(step["loss"]))
