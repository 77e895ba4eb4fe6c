"""One compilation of full orb-v2's training step (orb-smoke-test's) with MindSpore's compile options set first
(``NAME=VALUE`` arguments, ``mindspore.graph._parse.compile_config``): prints ``RESULT <compile s> <step s> <loss>``."""

import sys

from mindspore.graph._parse import compile_config

for option in sys.argv[1:]:
    name, value = option.split("=", 1)
    setattr(compile_config, name, value)

from orb.device import configure_mindspore  # noqa: E402  (after the options: the compiler reads them at its start)
from orb import smoke_test  # noqa: E402

configure_mindspore("CPU", precision="float32-highest")
step = smoke_test.training_step("CPU")
print("RESULT", step["compile_s"], step["step_s"], repr(step["loss"]))
