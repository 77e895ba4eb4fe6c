"""A training callback for ``benchmark.py restart`` (config ``callbacks: [restart_callback:FirstStep]``): writes the
wall-clock time of the first training step to ``$ORB_BENCH_FIRST_STEP`` and, with ``$ORB_BENCH_STOP_AT``, sends
the process SIGTERM at that global step (a scheduler's preemption, for the requeue case)."""

import os
import signal
import time


class FirstStep:
    def on_train_step(self, trainer, epoch, step_in_epoch, global_step):
        path = os.environ.get("ORB_BENCH_FIRST_STEP", "")
        if path and not os.path.exists(path):
            with open(path, "w") as f:
                f.write(repr(time.time()))
        if global_step == int(os.environ.get("ORB_BENCH_STOP_AT", "0") or 0):
            os.kill(os.getpid(), signal.SIGTERM)
