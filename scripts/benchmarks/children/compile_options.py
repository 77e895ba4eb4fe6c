"""One compilation of orb-v2's training step (orb-smoke-test's) with MindSpore's compile options set first
(``NAME=VALUE`` arguments, ``mindspore.graph._parse.compile_config``): prints ``RESULT <compile s> <step s> <loss>``.
``ORB_BENCH_MODEL=small``: the tests' 2-layer, 32-wide orb-v2 (random weights) in place of the full one."""

import os
import sys

from mindspore.graph._parse import compile_config

for option in sys.argv[1:]:
    name, value = option.split("=", 1)
    setattr(compile_config, name, value)

from orb.device import configure_mindspore  # noqa: E402  (after the options: the compiler reads them at its start)
from orb import smoke_test  # noqa: E402

configure_mindspore("CPU", precision="float32-highest")
model = None
if os.environ.get("ORB_BENCH_MODEL") == "small":
    from orb.models import create

    model = create("orb_v2", seed=0, latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2,
                   head_mlp_hidden_dim=32)
step = smoke_test.training_step("CPU", model)
print("RESULT", step["compile_s"], step["step_s"], repr(step["loss"]))
