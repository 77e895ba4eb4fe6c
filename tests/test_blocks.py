"""Building blocks in both operator profiles (``cpu`` and ``portable``, orb.models.ops_profile): LayerNorm's
gradient whatever the kernel's auxiliary outputs mean, the broadcasts and their gradients, the profile switch."""

import os

import numpy as np
import pytest

from conftest import own_compile_cache


def layer_norm_np(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def finite_difference_grads(x, w, b, dy, h=1e-6):
    """Central differences of sum(layer_norm(x) * dy) in float64."""
    def f(x_, w_, b_):
        return float((layer_norm_np(x_, w_, b_) * dy).sum())

    grads = []
    for arg in range(3):
        values = [x.copy(), w.copy(), b.copy()]
        g = np.zeros_like(values[arg])
        for idx in np.ndindex(g.shape):
            plus, minus = [v.copy() for v in values], [v.copy() for v in values]
            plus[arg][idx] += h
            minus[arg][idx] -= h
            g[idx] = (f(*plus) - f(*minus)) / (2 * h)
        grads.append(g)
    return grads


class RstdLayerNorm:
    """Stands for a backend whose LayerNorm kernel returns (y, mean, rstd), as Ascend's does, with a gradient
    kernel that reads rstd (CPU's LayerNormGrad reads the variance: the stand-in converts it back)."""

    def __new__(cls, eps):
        from mindspore import nn, ops
        from mindspore.ops.operations._grad_ops import LayerNormGrad

        class Kernel(nn.Cell):
            def __init__(self):
                super().__init__()
                self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)
                self.grad = LayerNormGrad(begin_norm_axis=-1, begin_params_axis=-1)

            def construct(self, x, w, b):
                y, mean, variance = self.norm(x, w, b)
                return y, mean, ops.rsqrt(variance + eps)

            def bprop(self, x, w, b, out, dout):
                variance = 1.0 / ops.square(out[2]) - eps
                return self.grad(x, dout[0], variance, out[1], w)

        return Kernel()


@pytest.fixture(params=["cpu", "portable"])
def profile(request):
    from orb.device import set_ops_profile

    set_ops_profile(request.param)
    yield request.param
    set_ops_profile("auto")


@pytest.mark.parametrize("kernel", ["cpu", "rstd"])
def test_layer_norm_gradient(kernel, profile):
    import mindspore as ms
    from mindspore import Tensor, nn

    from orb.models.blocks import LayerNorm

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    x = rng.normal(0.3, 2.0, (7, 32))
    w, b = 1 + 0.1 * rng.standard_normal(32), 0.1 * rng.standard_normal(32)
    dy = rng.standard_normal((7, 32))
    ours = LayerNorm(32)
    assert type(ours.function).__name__ == {"cpu": "_CpuLayerNorm", "portable": "_PortableLayerNorm"}[profile]
    from orb.models.kernels import library_path

    built = library_path() is not None  # the cpu profile's row kernel, where g++ built it
    assert getattr(ours.function, "fused", False) == (profile == "cpu" and built)
    ours.weight.set_data(Tensor(w.astype(np.float32)))
    ours.bias.set_data(Tensor(b.astype(np.float32)))
    if kernel == "rstd":
        ours.function.norm = RstdLayerNorm(1e-5)
        if profile == "cpu":
            ours.function.fused = False  # the built-in kernel, whose auxiliary outputs the backward must not read

    class Loss(nn.Cell):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def construct(self, x, dy):
            return (self.norm(x) * dy).sum()

    def gradients(cell):
        params = cell.trainable_params()
        grad_fn = ms.grad(Loss(cell), grad_position=0, weights=params)
        gx, (gw, gb) = grad_fn(Tensor(x.astype(np.float32)), Tensor(dy.astype(np.float32)))
        return gx.asnumpy(), gw.asnumpy(), gb.asnumpy()

    builtin = nn.LayerNorm((32,), begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)
    builtin.gamma.set_data(Tensor(w.astype(np.float32)))
    builtin.beta.set_data(Tensor(b.astype(np.float32)))
    expected = finite_difference_grads(x, w, b, dy)
    for got, reference, fd in zip(gradients(ours), gradients(builtin), expected):
        np.testing.assert_allclose(got, reference, atol=2e-5, rtol=1e-5)  # MindSpore's own LayerNormGrad
        np.testing.assert_allclose(got, fd, atol=2e-5, rtol=1e-5)  # float64 finite differences
    y = ours(Tensor(x.astype(np.float32))).asnumpy()
    np.testing.assert_allclose(y, layer_norm_np(x, w, b), atol=2e-6)


def test_rms_norm_and_scaled_rows_match_numpy_with_gradients(profile):
    """RMSNorm and row scaling: values and gradients against float64 finite differences, in both profiles."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from orb.models.blocks import RMSNorm, ScaleRows

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(7)
    x, gate, w = rng.normal(0.2, 1.5, (6, 16)), rng.standard_normal((6, 1)), 1 + 0.1 * rng.standard_normal(16)
    dy = rng.standard_normal((6, 16))
    eps = float(np.finfo(np.float32).eps)

    def f(x_, gate_, w_):
        normed = x_ / np.sqrt((x_ ** 2).mean(-1, keepdims=True) + eps) * w_
        return float((normed * gate_ * dy).sum())

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm, self.scale = RMSNorm(16), ScaleRows()

        def construct(self, x, gate, dy):
            return (self.scale(self.norm(x), gate) * dy).sum()

    net = Net()
    net.norm.weight.set_data(Tensor(w.astype(np.float32)))
    got = ms.grad(net, grad_position=(0, 1), weights=net.trainable_params())(
        *(Tensor(a.astype(np.float32)) for a in (x, gate, dy)))
    (gx, ggate), (gw,) = got
    for arg, computed in enumerate((gx, ggate, gw)):
        values = [x.copy(), gate.copy(), w.copy()]
        expected = np.zeros_like(values[arg])
        for idx in np.ndindex(expected.shape):
            plus, minus = [v.copy() for v in values], [v.copy() for v in values]
            plus[arg][idx] += 1e-6
            minus[arg][idx] -= 1e-6
            expected[idx] = (f(*plus) - f(*minus)) / 2e-6
        np.testing.assert_allclose(computed.asnumpy(), expected, atol=5e-5, rtol=1e-4)


def test_ops_profile_switch(monkeypatch):
    """``ORB_OPS_PROFILE`` (over the configured ``ops_profile``) chooses the cells' forms: ``portable`` builds
    MindSpore's operators (built-in activations, framework gradients), ``cpu`` the custom kernels and
    hand-written backward passes; ``auto`` is ``cpu`` on the CPU; anything else is one clear error."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from orb import device
    from orb.errors import ConfigError
    from orb.models import kernels, ops_profile
    from orb.models.blocks import Linear

    ms.set_context(mode=ms.GRAPH_MODE)
    x = np.linspace(-30, 30, 4001).astype(np.float32)
    exact = np.logaddexp(0.0, x.astype(np.float64)) - np.log(2.0)
    device.set_ops_profile("cpu")
    monkeypatch.setenv("ORB_OPS_PROFILE", "portable")  # the environment wins
    assert device.ops_profile() == "portable" and not ops_profile.uses_custom_kernels()
    assert type(Linear(4, 3, np.random.default_rng(0)).function).__name__ == "_PortableLinear"
    builtin = ops_profile.activation("ssp")
    assert not isinstance(builtin, ops.Custom)
    builtin_err = np.abs(builtin(Tensor(x)).asnumpy() - exact).max()
    monkeypatch.setenv("ORB_OPS_PROFILE", "auto")
    if kernels.library_path() is None:
        pytest.fail("the custom kernels could not be built (a C++ compiler is part of the test environment)")
    assert device.ops_profile() == "cpu"  # auto on the CPU
    assert type(Linear(4, 3, np.random.default_rng(0)).function).__name__ == "_CpuLinear"
    custom = ops_profile.activation("ssp")
    assert isinstance(custom, ops.Custom) and ops_profile.uses_custom_kernels()
    custom_err = np.abs(custom(Tensor(x)).asnumpy() - exact).max()
    assert custom_err <= 4e-6 and builtin_err <= 1e-5  # both usable; the custom one is the accurate one
    assert custom_err <= builtin_err
    monkeypatch.setenv("ORB_OPS_PROFILE", "fast")
    with pytest.raises(ConfigError, match="ORB_OPS_PROFILE must be one of auto, portable, cpu"):
        device.ops_profile()
    device.set_ops_profile("auto")


def test_cpu_profile_is_refused_off_the_cpu(monkeypatch):
    """The cpu profile's forms and custom kernels must never reach an NPU or a GPU: configured or left in the
    environment, it is one line naming where it came from; auto is portable there."""
    from orb.errors import ConfigError
    from orb.device import choose_profile

    monkeypatch.delenv("ORB_OPS_PROFILE", raising=False)
    for device in ("Ascend", "GPU"):
        assert choose_profile("auto", device) == "portable" and choose_profile("portable", device) == "portable"
        with pytest.raises(ConfigError, match=f"ops_profile: cpu is for the CPU only, and this run is on {device}"):
            choose_profile("cpu", device)
    monkeypatch.setenv("ORB_OPS_PROFILE", "cpu")
    with pytest.raises(ConfigError, match="ORB_OPS_PROFILE=cpu .environment. is for the CPU only.*unset"):
        choose_profile("cpu", "Ascend")
    assert choose_profile("cpu", "CPU") == "cpu" and choose_profile("auto", "CPU") == "cpu"


def test_kernel_cache_falls_back(monkeypatch, tmp_path):
    """An unwritable cache folder falls back to a temporary one; the cache key includes the CPU flags."""
    from orb import native
    from orb.models import kernels

    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")  # a cache path below a file cannot be created, even by root
    for key, value in own_compile_cache(blocker / "cache").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    native.build.cache_clear()
    try:
        path = kernels.library_path()
        assert path is not None and path.startswith(str(tmp_path / "tmp"))
        assert native.build(kernels.SOURCE, "", native.cpu_signature()) == path
        assert native.build(kernels.SOURCE, "", "another cpu") != path  # a different CPU never loads this build
    finally:
        native.build.cache_clear()


def test_compile_cell_compiles_the_phase_the_run_uses():
    """The trainer and predictor compile before the first run (then return the compiler's freed heap):
    the run must reuse that compilation, not compile again, and give the same numbers."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from orb.graph_cache import compile_cell

    ms.set_context(mode=ms.GRAPH_MODE)
    cell = nn.Dense(4, 3)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    compile_cell(cell, Tensor(x))
    assert len(cell.compile_cache) == 1  # compiled before any run
    out = cell(Tensor(x)).asnumpy()
    assert len(cell.compile_cache) == 1
    expected = x @ cell.weight.asnumpy().T + cell.bias.asnumpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_matmul_precision_reaches_the_accelerator(monkeypatch):
    """matmul_precision: ``high`` allows HF32 on Ascend (TF32 on GPU), ``highest`` forbids it; on Ascend CANN is
    always asked to keep float32 operators float32 (not float16, its choice on some chips and releases); the
    CPU is left alone. Set after selecting the device."""
    import mindspore as ms
    from mindspore.device_context.ascend import op_precision as ascend
    from mindspore.device_context.gpu import op_precision as gpu

    from orb import device

    calls = []
    monkeypatch.setattr(device, "device_available", lambda target: True)  # as on a machine that has both
    monkeypatch.setattr(ms, "set_device", lambda *a, **k: calls.append(("set_device",) + a))
    monkeypatch.setattr(ms, "set_context", lambda **k: None)
    monkeypatch.setattr(ascend, "precision_mode", lambda mode: calls.append(("precision_mode", mode)))
    monkeypatch.setattr(ascend, "matmul_allow_hf32", lambda value: calls.append(("matmul_allow_hf32", value)))
    monkeypatch.setattr(gpu, "matmul_allow_tf32", lambda value: calls.append(("matmul_allow_tf32", value)))
    assert device.configure_mindspore("Ascend", device_id=3) == "Ascend"
    assert calls == [("set_device", "Ascend", 3), ("precision_mode", "must_keep_origin_dtype"),
                     ("matmul_allow_hf32", True)]
    calls.clear()
    device.configure_mindspore("Ascend", precision="float32-highest")
    assert calls[1:] == [("precision_mode", "must_keep_origin_dtype"), ("matmul_allow_hf32", False)]
    calls.clear()
    device.configure_mindspore("GPU", precision="float32-highest")
    assert calls[1:] == [("matmul_allow_tf32", False)]
    calls.clear()
    device.configure_mindspore("CPU")
    assert [c[0] for c in calls] == ["set_device"]  # nothing accelerator-specific elsewhere


def test_a_device_mindspore_cannot_use_here_is_one_line():
    """device_target GPU on a machine (or a MindSpore build) without one was MindSpore's RuntimeError with a C++
    stack; a misspelt or lower-case name went to MindSpore too."""
    from orb.device import device_available, select_device
    from orb.errors import ConfigError

    assert select_device("cpu") == "CPU" and select_device("auto") in ("CPU", "GPU", "Ascend")
    for target in ("GPU", "Ascend"):
        if not device_available(target):
            with pytest.raises(ConfigError, match=f"device_target {target}: MindSpore cannot use {target} devices"):
                select_device(target)
    with pytest.raises(ConfigError, match="device_target must be one of auto, Ascend, GPU, CPU, got 'cuda'"):
        select_device("cuda")


def test_a_deterministic_cpu_run_refuses_a_kernel_pool_of_several_threads():
    """deterministic on the CPU is one kernel thread (its bits: tests/test_preemption.py): num_threads above 1 is
    refused, and so is a process whose pool an earlier run already sized otherwise (MindSpore sizes it once; the
    run would have kept the earlier size and called itself deterministic)."""
    import subprocess
    import sys

    from conftest import ROOT
    from orb.device import configure_mindspore
    from orb.errors import ConfigError

    with pytest.raises(ConfigError, match="'num_threads' \\(4\\): a deterministic run on the CPU uses one kernel "
                                          "thread"):
        configure_mindspore("CPU", num_threads=4, deterministic=True)
    script = ("from orb.device import configure_mindspore\n"
              "configure_mindspore('CPU', num_threads=1)\n"
              "configure_mindspore('CPU', deterministic=True)\n"  # one thread already: deterministic
              "print('one thread: deterministic')\n")
    again = subprocess.run([sys.executable, "-c", script.replace("num_threads=1", "num_threads=2")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "already has 2 threads, set by an earlier run in it; a deterministic run " \
                                     "needs one" in again.stderr, again.stderr[-2000:]
    same = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "one thread: deterministic" in same.stdout, same.stderr[-2000:]


BLAS_PROBE = """
import json, os, sys, tempfile
import numpy, scipy.linalg
from orb.host_blas import blas_threads
before = blas_threads()
caller, num_threads = sys.argv[1], int(sys.argv[2])
if caller == "worker":
    from orb.data.loader import _init_worker
    _init_worker({})
elif caller == "calculator":
    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import save_checkpoint
    from orb.models import create
    path = os.path.join(tempfile.mkdtemp(), "model.ckpt")
    save_checkpoint(path, create("orb_v2", latent_dim=8, mlp_hidden_dim=8, num_message_passing_steps=1,
                                 head_mlp_hidden_dim=8))
    ORBCalculator.from_checkpoint(path, device_target="CPU")
else:
    from orb.device import configure_mindspore
    configure_mindspore("CPU", num_threads=num_threads)
print(json.dumps([before, blas_threads()]))
"""


@pytest.mark.parametrize("caller,num_threads,user_setting,expected", [
    ("command", 0, None, 1), ("command", 2, None, 2), ("command", 64, None, "before"), ("worker", 0, None, 1),
    ("calculator", 0, None, "before"), ("command", 0, "2", "before")])
def test_a_commands_host_blas_takes_the_kernel_threads_count(caller, num_threads, user_setting, expected):
    """numpy's and SciPy's OpenBLAS pools (one thread per core unless told) only spun on the host's 3x3 solves:
    a command's process and each data worker size them as the kernel threads (one if unset), never larger than
    they started; the calculator in a user's script and a user's OPENBLAS_NUM_THREADS leave them as they were. A
    fresh process each: a pool's size is the process's."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOTO_NUM_THREADS")}
    if user_setting:
        env["OPENBLAS_NUM_THREADS"] = user_setting
    result = subprocess.run([sys.executable, "-c", BLAS_PROBE, caller, str(num_threads)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = json.loads(result.stdout.strip().splitlines()[-1])
    assert before and set(after) == set(before)  # numpy's and SciPy's OpenBLAS (one library in some builds)
    assert after == (before if expected == "before" else {path: expected for path in before})


def test_broadcasts_are_exact_and_their_gradients_are_sums(profile):
    """Broadcasts' column/row (products with ones under ``cpu``, BroadcastTo under ``portable``) repeat values
    exactly; their gradients, also differentiated a second time as conservative models do, are row/column sums."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from orb.models.primitives import Broadcasts

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(1)
    col, row = rng.standard_normal((7, 1)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    weight = rng.standard_normal((7, 5)).astype(np.float32)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.broadcasts = Broadcasts()

        def construct(self, c, r, w):
            return (self.broadcasts.column(c, 5) * self.broadcasts.row(r, 7) * w).sum()

    class Grad(nn.Cell):  # sum of (df/dc)^2, whose gradient is a second derivative through the expansions
        def __init__(self):
            super().__init__()
            self.net, self.grad = Net(), ops.GradOperation(get_all=True)

        def construct(self, c, r, w):
            dc = self.grad(self.net)(c, r, w)[0]
            return (dc * dc).sum()

    out = Net()(Tensor(col), Tensor(row), Tensor(weight)).asnumpy()
    np.testing.assert_allclose(out, (col * row * weight).sum(), rtol=1e-5)
    dc = ops.GradOperation(get_all=True)(Net())(Tensor(col), Tensor(row), Tensor(weight))
    np.testing.assert_allclose(dc[0].asnumpy(), (row * weight).sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dc[1].asnumpy(), (col * weight).sum(0), rtol=1e-5, atol=1e-6)
    d2 = ops.GradOperation(get_all=True)(Grad())(Tensor(col), Tensor(row), Tensor(weight))
    # g = (sum_j r_j w_ij)_i; d/dr_k sum_i g_i^2 = 2 sum_i g_i w_ik
    g = (row * weight).sum(1, keepdims=True)
    np.testing.assert_allclose(d2[1].asnumpy(), 2 * (g * weight).sum(0), rtol=1e-4, atol=1e-5)


def test_segment_sums_gradients_equal_mindspores_to_the_bit(profile):
    """The messages' segment sum (``SegmentSum``; under ``cpu`` its gradient the gather alone, without MindSpore's
    range masks) gives MindSpore's own ``unsorted_segment_sum`` values, gradient and second derivative (a
    conservative model's training) to the bit, with segments of 0 to 9 rows."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from orb.models.blocks import SegmentSum

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(3)
    ids = np.sort(rng.integers(0, 9, 40)).astype(np.int32)
    ids[ids == 4] = 5  # an empty segment
    x, w = rng.standard_normal((40, 6)).astype(np.float32), rng.standard_normal((6, 6)).astype(np.float32)

    class Energy(nn.Cell):
        def __init__(self, ours):
            super().__init__()
            self.ours, self.segment_sum = ours, SegmentSum()

        def construct(self, x, w, ids):
            h = ops.tanh(ops.matmul(x, w))
            s = self.segment_sum(h, ids, 9) if self.ours else ops.unsorted_segment_sum(h, ids, 9)
            return (ops.tanh(s) ** 2).sum()

    class ForcesSquared(nn.Cell):  # its gradient in w differentiates the segment sum's gradient once more
        def __init__(self, ours):
            super().__init__()
            self.energy, self.grad = Energy(ours), ops.GradOperation()

        def construct(self, x, w, ids):
            f = self.grad(self.energy)(x, w, ids)
            return (f * f).sum()

    results = []
    for ours in (True, False):
        args = Tensor(x), Tensor(w), Tensor(ids)
        second = ops.GradOperation(get_all=True)(ForcesSquared(ours))(*args)
        results.append([Energy(ours)(*args), ops.GradOperation()(Energy(ours))(*args), second[0], second[1]])
    assert type(SegmentSum().function).__name__ == {"cpu": "_CpuSegmentSum", "portable": "_PortableSegmentSum"}[profile]
    for ours, theirs in zip(*results):
        assert np.array_equal(ours.asnumpy(), theirs.asnumpy())
    assert np.abs(results[0][3].asnumpy()).max() > 0


@pytest.mark.parametrize("name", ["orb_v2", "orb_v3_conservative_20_omat", "orb_v3_direct_omol"])
def test_portable_models_hold_no_cpu_forms(name, profile):
    """Built under ``portable``, a model (and its loss and optimizer) contains no hand-written backward pass, no
    custom kernel and no ones-vector broadcast; under ``cpu`` it does (so the check can fail)."""
    from mindspore import ops

    from orb.models import create
    from orb.models.primitives import Broadcasts
    from orb.training.config import config_from_dict
    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant
    from orb.training.engine import make_loss

    small = dict(latent_dim=16, mlp_hidden_dim=16, num_message_passing_steps=1, head_mlp_hidden_dim=16)
    model = create(name, **small)
    cfg = config_from_dict(dict(model=dict(small, name=name)))
    cells = [model, make_loss(model, cfg, has_stress=True), FlatAdam(model.trainable_params(), constant(1e-3, 2))]
    custom_bprops, custom_kernels, ones_products = [], [], []
    for top in cells:
        for path, cell in top.cells_and_names():
            if "bprop" in type(cell).__dict__:
                custom_bprops.append(path or type(cell).__name__)
            if isinstance(cell, Broadcasts) and cell.cpu:
                ones_products.append(path)
            for attr, value in vars(cell).items():
                if isinstance(value, ops.Custom):
                    custom_kernels.append(f"{path}.{attr}")
    if profile == "portable":
        assert not custom_bprops and not custom_kernels and not ones_products, (custom_bprops[:3], custom_kernels[:3])
    else:
        assert custom_bprops and ones_products
        assert any(p.endswith("segment_sum.function") for p in custom_bprops), custom_bprops[:5]  # the messages'
        assert any(k.endswith("layer_norm.function.kernel") for k in custom_kernels), custom_kernels[:5]  # the norms
        assert any(k.endswith("edge_input.kernel.kernel") for k in custom_kernels), custom_kernels[:5]  # edges in
        assert any(p.endswith("edge_input.kernel") for p in custom_bprops), custom_bprops[:5]


def test_openmps_thread_lists_and_stray_values_size_the_pool_without_a_traceback():
    """OMP_NUM_THREADS may list a count per nesting level (4,2: the kernels take the first); a value that names no
    count (abc) is MindSpore's default pool, as unset (both were a ValueError traceback at start-up)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    for value, threads in (("4,2", 4), ("3", 3), ("abc", 0), ("", 0)):
        result = subprocess.run([sys.executable, "-c", "from orb.device import omp_threads; print(omp_threads())"],
                                cwd=ROOT, capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, OMP_NUM_THREADS=value))
        assert result.returncode == 0 and result.stdout.strip() == str(threads), (value, result.stderr[-500:])


class _Activation:
    """(f(x), d/dx sum(f(x) w)) of one activation: its kernel and the kernel of its derivative."""

    def __new__(cls, name):
        import mindspore as ms
        from mindspore import nn, ops

        from orb.models.kernels import exp_nonpositive_op, library_path, shifted_softplus_op, silu_op

        f = {"ssp": shifted_softplus_op, "silu": silu_op, "exp_nonpositive": exp_nonpositive_op}[name](library_path())

        class Weighted(nn.Cell):
            def __init__(self):
                super().__init__()
                self.f = f

            def construct(self, x, w):
                return (self.f(x) * w).sum()

        class Both(nn.Cell):
            def __init__(self):
                super().__init__()
                self.f, self.first = f, ops.grad(Weighted(), grad_position=0)

            def construct(self, x, w):
                return self.f(x), self.first(x, w)

        ms.set_context(mode=ms.GRAPH_MODE)
        return Both()


@pytest.mark.parametrize("name", ["ssp", "silu", "exp_nonpositive"])
def test_the_accurate_kernels_run_in_a_graph_of_dynamic_shapes_as_in_one_per_shape(name):
    """The cpu profile's custom activation kernels and their derivatives in one graph compiled for inputs of any length (MindSpore failed with "The pointer[value] is null" when their shape came from Python):
    each length gives the values a graph compiled for that length gives, bit for bit, and the derivatives float64
    numpy computes."""
    import mindspore as ms
    from mindspore import Tensor

    from orb.models.kernels import library_path

    if library_path() is None:
        pytest.fail("no C++ compiler: the kernels cannot be built here")
    dynamic = _Activation(name)
    dynamic.set_inputs(*[Tensor(shape=[None, 4], dtype=ms.float32)] * 2)
    rng = np.random.default_rng(0)
    for rows in (3, 11, 5):
        x, w = (rng.normal(size=(rows, 4)).astype(np.float32) * 4 for _ in range(2))
        got = [t.asnumpy() for t in dynamic(Tensor(x), Tensor(w))]
        fixed = [t.asnumpy() for t in _Activation(name)(Tensor(x), Tensor(w))]
        for a, b in zip(got, fixed):
            assert a.shape == (rows, 4)
            np.testing.assert_array_equal(a, b)
        x64 = x.astype(np.float64)
        sigmoid = 1 / (1 + np.exp(-x64))
        slope = {"ssp": sigmoid, "silu": sigmoid * (1 + x64 * (1 - sigmoid)),
                 "exp_nonpositive": np.exp(np.minimum(x64, 0)) * (x64 <= 0)}[name]
        np.testing.assert_allclose(got[1], slope * w, rtol=2e-6, atol=1e-6)


class _Norm:
    """A LayerNorm or RMSNorm of ``width`` with random weights, as a cell taking x."""

    def __new__(cls, kind, width, seed=0):
        from mindspore import Tensor

        from orb.models.blocks import LayerNorm, RMSNorm

        rng = np.random.default_rng(seed)
        norm = (LayerNorm if kind == "layer_norm" else RMSNorm)(width)
        norm.weight.set_data(Tensor((1 + 0.3 * rng.standard_normal(width)).astype(np.float32)))
        if kind == "layer_norm":
            norm.bias.set_data(Tensor((0.3 * rng.standard_normal(width)).astype(np.float32)))
        return norm


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_the_norm_kernels_match_float64_at_every_width_and_row_count(kind):
    """The cpu profile's LayerNorm and RMSNorm row kernels: 1,500 rows (a 64-atom cell's edges) of widths with and
    without a tail beyond the kernel's 16 lanes, rows far from zero mean (a float sum of such a row loses its spread),
    within float32 rounding of float64 numpy and no farther than MindSpore's own operators;
    the rows permuted give the rows' outputs permuted, bit for bit; a graph compiled for any number of rows gives
    the bits of one compiled for each."""
    import mindspore as ms
    from mindspore import Tensor

    from orb.models.kernels import library_path

    if library_path() is None:
        pytest.fail("no C++ compiler: the kernels cannot be built here")
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(3)
    for width in (5, 32, 37, 256):
        norm = _Norm(kind, width)
        assert norm.function.fused
        w = norm.weight.asnumpy().astype(np.float64)
        x = (rng.normal(size=(1500, width)) * rng.uniform(0.01, 30, (1500, 1)) + rng.uniform(-50, 50, (1500, 1)))
        x = x.astype(np.float32)
        got = norm(Tensor(x)).asnumpy()
        x64 = x.astype(np.float64)
        if kind == "layer_norm":
            expected = layer_norm_np(x64, w, norm.bias.asnumpy().astype(np.float64))
        else:
            expected = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + float(np.finfo(np.float32).eps)) * w
        error = np.abs(got - expected).max()
        assert error <= 1e-6 * np.abs(expected).max(), (width, error)  # a few float32 roundings of the largest
        unfused = _Norm(kind, width)
        unfused.function.fused = False  # MindSpore's LayerNorm kernel, or RMSNorm's operators
        assert error <= np.abs(unfused(Tensor(x)).asnumpy() - expected).max(), width
        order = rng.permutation(len(x))
        np.testing.assert_array_equal(norm(Tensor(x[order])).asnumpy(), got[order])
    dynamic, fixed = _Norm(kind, 37), _Norm(kind, 37)
    dynamic.set_inputs(Tensor(shape=[None, 37], dtype=ms.float32))
    for rows in (3, 1100, 17):
        x = rng.normal(size=(rows, 37)).astype(np.float32)
        np.testing.assert_array_equal(dynamic(Tensor(x)).asnumpy(), fixed(Tensor(x)).asnumpy())


def test_the_kernels_full_vector_width_is_asked_for_only_where_the_cpu_has_it(monkeypatch):
    """-mprefer-vector-width is an x86 option: an ARM host (Kunpeng beside an Ascend card) or an x86 CPU without
    AVX-512 builds with the plain flags (g++ would refuse the option on ARM, and the kernels fall back)."""
    from orb import native

    for signature, wide in (("fpu sse2 avx2 avx512f avx512bw", True), ("fpu sse2 avx2", False),
                            ("fp asimd evtstrm aes pmull sha1 sha2 crc32", False)):
        monkeypatch.setattr(native, "cpu_signature", lambda signature=signature: signature)
        flags = native.compiler_flags()
        assert flags[:len(native.FLAGS)] == native.FLAGS
        assert ("-mprefer-vector-width=512" in flags) == wide


def test_the_norm_kernels_refuse_arrays_other_than_float32():
    """The row kernels read float32: a float16 array handed to one (a precision mode's path that never reached
    them when this was written) is an error, not garbage read as floats."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from orb.models.kernels import layer_norm_kernel, library_path

    path = library_path()
    if path is None:
        pytest.fail("no C++ compiler: the kernels cannot be built here")
    ms.set_context(mode=ms.GRAPH_MODE)

    class Norm(nn.Cell):
        def __init__(self):
            super().__init__()
            self.kernel = layer_norm_kernel(path)

        def construct(self, x, w, b, eps):
            return self.kernel(x, w, b, eps)

    x, w, eps = np.ones((4, 8)), np.ones(8), np.array(1e-5)
    ok = Norm()(*(Tensor(a.astype(np.float32)) for a in (x, w, w, eps))).asnumpy()
    assert ok.dtype == np.float32 and np.isfinite(ok).all()
    with pytest.raises(RuntimeError, match="OrbLayerNorm"):
        Norm()(*(Tensor(a.astype(np.float16)) for a in (x, w, w, eps))).asnumpy()


def test_a_compiler_without_the_vector_width_option_still_builds_the_kernels(monkeypatch, tmp_path):
    """GCC 7 (openEuler 20.03, Ubuntu 18.04) has no -mprefer-vector-width: on an AVX-512 host it builds the library
    with the plain flags instead of losing the accurate kernels and the neighbour search."""
    from orb import native
    from orb.models import kernels

    old_gcc = tmp_path / "g++-7"
    old_gcc.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -mprefer-vector-width=*) '
                       'echo "g++: error: unrecognized command-line option $a" >&2; exit 1;; esac; done\n'
                       'exec g++ "$@"\n')
    old_gcc.chmod(0o755)
    for key, value in own_compile_cache(tmp_path / "cache").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CXX", str(old_gcc))
    monkeypatch.setattr(native, "cpu_signature", lambda: "fpu sse2 avx2 avx512f")
    native.build.cache_clear()
    try:
        path = kernels.library_path()
        assert path is not None and path.startswith(str(tmp_path / "cache"))
    finally:
        native.build.cache_clear()
