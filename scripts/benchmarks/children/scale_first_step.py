"""``finetune.py`` for ``benchmark.py scale``, stopped at its first training step: ``scale_first_step.py
FINETUNE-ARGUMENTS...`` runs ``finetune.main`` with those arguments (from the checkout's top, as the README's
commands) plus the callback ``FirstStep`` below, which at the first step measures planning, row reads and batch
preparation, prints ``RESULT {json}`` and leaves."""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
REPLAY_STEPS = 200  # the steps whose rows are read and prepared


def peak_gb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1e6  # noqa: E741


class FirstStep:
    """A callback (config key ``callbacks``): at the first training step, measure and leave."""

    def on_train_step(self, trainer, epoch, step_in_epoch, global_step):
        from orb.data.loader import prepare

        validation = sum(m.get("val_time", 0.0) for m in trainer.progress.initial.values())
        at_first_step = time.time() - validation  # the pass before fine-tuning is not start-up
        data = trainer.data
        timings = []
        for e in (1, 2, 3):
            start = time.perf_counter()
            steps = data.train_steps(e)
            timings.append(time.perf_counter() - start)
        take = [s for s in steps[:REPLAY_STEPS]]
        source = data.train_set.sources[0].dataset
        start, rows = time.perf_counter(), 0
        for step in take:
            rows += len(source.rows.read_many([data.train_set.row_id(i) for i in step.indices]))
        read = rows / (time.perf_counter() - start)
        start = time.perf_counter()
        for step in take:
            prepare(data.train_set, step, 0, data.has_stress)
        prepared = rows / (time.perf_counter() - start)
        print("RESULT " + json.dumps({
            "first_step": at_first_step, "plan_s": timings, "peak_gb": peak_gb(), "rows_per_s": read,
            "prepared_per_s": prepared, "train_padding": data.train_padding,
            "val_padding": {k: p.padding for k, p in data.val_plans.items()},
            "buckets": [[b.num_nodes, b.num_edges, b.spare] for b in data.train_buckets],
            "val_buckets": {k: [[b.num_nodes, b.num_edges] for b in p.buckets] for k, p in data.val_plans.items()},
            "compile_s": trainer.engine.compiled.total(), "steps_per_epoch": data.steps_per_epoch}), flush=True)
        data.loader.close()
        os._exit(0)


# Only in the program itself: not when finetune imports this file for the callback (as ``scale_first_step``), nor in
# the data workers, which import this file as their main module (multiprocessing's spawn).
if __name__ == "__main__":
    import finetune
    finetune.main(sys.argv[1:] + ["--callbacks", "[scale_first_step:FirstStep]"])
