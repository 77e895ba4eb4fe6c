"""The first-hour check for NPU users (orb-smoke-test): it passes on a working machine and fails on a wrong model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT


@pytest.mark.beside_light  # its processes peak at 3.6 GB together (2026-11-28)
def test_smoke_test_passes_and_prints_a_report():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "smoke_test.py"), "--precisions",
                             "float32-high,fp16-mixed"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = result.stdout
    report = json.loads(text.split("--- paste from here into a bug report ---")[1].split("--- end ---")[0])
    assert report["environment"]["device_target"] == "CPU"
    for check in ("predictions_vs_pytorch", "training_step_vs_cpu", "two_worker_sum"):
        assert report[check]["passed"], (check, report[check])
    assert report["two_worker_sum"]["workers"] == 2
    assert "portable profile" in report["training_step_vs_cpu"]["compared"]  # on a CPU: the two profiles
    assert text.rstrip().endswith("all checks passed")
    steps = report["training_step_by_precision"]  # one training step timed in each mode asked for
    assert steps["fp16-mixed"]["step_s"] > 0 and steps["fp16-mixed"]["speed_up_over_float32_high"] > 0
    assert abs(steps["fp16-mixed"]["loss"] - steps["float32-high"]["loss"]) < 1e-2 * abs(steps["float32-high"]["loss"])


def test_smoke_test_fails_on_a_wrong_model():
    """A model whose weights differ slightly from PyTorch's (one output bias moved by 1e-3) must fail the check."""
    import mindspore as ms

    from orb import smoke_test

    ms.set_context(mode=ms.GRAPH_MODE)
    model = smoke_test.reference_model(np.load(smoke_test.REFERENCE))
    bias = model.graph_head.mlp.layer(-1).bias
    bias.set_data(ms.Tensor(bias.asnumpy() + 1e-3))
    result = smoke_test.check_predictions(model)
    assert not result["passed"] and result["worst_error_over_tolerance"]["energy"] > 1.0


def test_only_the_float32_modes_reuse_the_cpu_step():
    """On a CPU the float32 modes report the device comparison's step; any other name is still run, so a misspelt
    one is refused in one line instead of reported with float32's timing."""
    from orb import smoke_test

    step = {"loss": 1.5, "grad_norm": 2.0, "compile_s": 3.0, "step_s": 0.5}
    out = smoke_test.time_precisions("CPU", ["float32-high", "float32-hihg"], cpu_step=step)
    assert out["float32-high"]["step_s"] == 0.5 and out["float32-high"]["loss"] == 1.5
    assert "step_s" not in out["float32-hihg"] and "float32-hihg" in out["float32-hihg"]["error"]


def test_a_misspelt_precision_and_a_stop_signal_are_one_line():
    """orb-smoke-test took no part in the stop protocol (a stop signal was a traceback and exit 1, or 143) and reported
    a misspelt --precisions as not run, every check passing."""
    import signal

    from conftest import wait_until_handling

    script = os.path.join(ROOT, "scripts", "smoke_test.py")
    refused = subprocess.run([sys.executable, script, "--precisions", "float32-high,fp16-mixd"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --precisions: fp16-mixd not among float32-high, float32-highest, bf16-mixed, fp16-mixed, float64"], \
        refused.stderr[-2000:]
    process = subprocess.Popen([sys.executable, script, "--precisions", ""], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_until_handling(process, signal.SIGUSR1)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 75 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("stopped by SIGUSR1"), err[-2000:]
