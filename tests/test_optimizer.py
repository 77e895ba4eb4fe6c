"""The flat Adam optimizer: torch.optim.Adam's update (bias correction, per-step lr and beta1), the
same update as MindSpore's nn.Adam, gradient clipping, the EMA of the weights; the schedules."""

import math

import numpy as np
import pytest

from orb.training.schedule import make_schedule, one_cycle, warmup_cosine


def torch_adam_reference(params, grads_per_step, lrs, beta1s, beta2=0.999, eps=1e-8, clip=None):
    """torch.optim.Adam (single tensor, amsgrad off, no weight decay), written out in float64."""
    params = [p.astype(np.float64).copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step, start=1):
        lr, b1 = lrs[step - 1], beta1s[step - 1]
        if clip is not None:
            grads = [np.clip(g, -clip, clip) for g in grads]
        for p, g, m_, v_ in zip(params, grads, m, v):
            m_ += (1 - b1) * (g - m_)
            v_ *= beta2
            v_ += (1 - beta2) * g * g
            denom = np.sqrt(v_) / math.sqrt(1 - beta2 ** step) + eps
            p -= lr / (1 - b1 ** step) * m_ / denom
    return params


def gradients(grads):
    """Gradients as a step receives them: inputs of the compiled update (a tuple of tensors alone would be constants
    of its graph, compiled again at every step)."""
    import mindspore as ms
    from mindspore import Tensor

    return ms.mutable(tuple(Tensor(g) for g in grads))


def make_params(rng):
    from mindspore import Parameter, Tensor

    shapes = [(7, 5), (5,), (3, 2, 4), ()]
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    return values, [Parameter(Tensor(v), name=f"p{i}") for i, v in enumerate(values)]


@pytest.mark.parametrize("schedule", ["one_cycle", "constant"])
def test_flat_adam_is_torch_adam(schedule):
    import mindspore as ms

    from orb.training.optimizer import FlatAdam

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(1)
    values, params = make_params(rng)
    sched = make_schedule(schedule, 1e-2, 12, 0.3)
    opt = FlatAdam(params, sched, clip_mode="value", clip_value=0.8)
    grads_per_step = [[rng.standard_normal(v.shape).astype(np.float32) for v in values] for _ in range(12)]
    for grads in grads_per_step:
        opt(gradients(grads))
    expected = torch_adam_reference(values, grads_per_step, sched.lr, sched.beta1, clip=0.8)
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.asnumpy(), e, rtol=2e-5, atol=2e-6)
    assert int(opt.step.asnumpy()) == 12


def test_flat_adam_equals_mindspore_adam():
    """On one device, the same parameters as nn.Adam step after step (constant lr, eps negligible)."""
    import mindspore as ms
    from mindspore import nn

    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(2)
    values, ours = make_params(rng)
    _, theirs = make_params(np.random.default_rng(2))
    flat = FlatAdam(ours, constant(3e-3, 10), clip_mode="none")
    adam = nn.Adam(theirs, learning_rate=3e-3)
    for _ in range(10):
        grads = gradients([rng.standard_normal(v.shape).astype(np.float32) for v in values])
        flat(grads)
        adam(grads)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)


def test_norm_clipping_and_ema():
    import mindspore as ms

    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(3)
    values, params = make_params(rng)
    opt = FlatAdam(params, constant(1e-2, 5), clip_mode="norm", clip_value=0.5, ema_decay=0.9)
    ema = np.concatenate([v.reshape(-1) for v in values]).astype(np.float64)
    grads_per_step = []
    for step in range(5):
        grads = [(10 * rng.standard_normal(v.shape)).astype(np.float32) for v in values]
        norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
        grads_per_step.append([g * min(0.5 / (norm + 1e-6), 1.0) for g in grads])
        opt(gradients(grads))
        now = np.concatenate([p.asnumpy().reshape(-1) for p in params])
        decay = min(0.9, (1 + step) / (10 + step))
        ema = ema + (1 - decay) * (now - ema)
    expected = torch_adam_reference(values, grads_per_step, [1e-2] * 5, [0.9] * 5)
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.asnumpy(), e, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(opt.ema.asnumpy(), ema, rtol=1e-5, atol=1e-6)


def test_sgd_steps_are_lr_times_the_clipped_gradient():
    """optimizer: sgd is torch.optim.SGD (no momentum): w <- w - lr_t clip(g), with the schedule's lr_t."""
    import mindspore as ms

    from orb.training.optimizer import FlatAdam

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(4)
    values, params = make_params(rng)
    sched = make_schedule("one_cycle", 1e-2, 6, 0.3)
    opt = FlatAdam(params, sched, clip_mode="value", clip_value=0.8, algorithm="sgd")
    expected = [v.astype(np.float64) for v in values]
    for step in range(6):
        grads = [rng.standard_normal(v.shape).astype(np.float32) for v in values]
        opt(gradients(grads))
        expected = [e - sched.lr[step] * np.clip(g, -0.8, 0.8) for e, g in zip(expected, grads)]
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.asnumpy(), e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("extra,mode", [(-3, "graph"), (1, "graph"), (0, "graph"), (7, "pynative")])
def test_more_parameters_than_a_write_group_each_get_their_own_update(extra, mode):
    """The update is written back in groups of WRITE_GROUP parameters (a shorter compilation): with one group, two
    full groups and none or a partial one (of one parameter, or seven), compiled or op by op, every parameter,
    scalars included, gets exactly its own slice of the flat update, step after step."""
    import mindspore as ms
    from mindspore import Parameter, Tensor

    from orb.training.optimizer import WRITE_GROUP, FlatAdam
    from orb.training.schedule import constant

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        rng = np.random.default_rng(5)
        count = WRITE_GROUP + extra if extra < 0 else 2 * WRITE_GROUP + extra
        shapes = [[(3, 4), (5,), (), (2, 1, 3), (2, 2)][i % 5] for i in range(count)]  # groups of other shapes
        values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        params = [Parameter(Tensor(v), name=f"q{i}") for i, v in enumerate(values)]
        opt = FlatAdam(params, constant(0.25, 2), clip_mode="none", algorithm="sgd")
        assert len(opt.write_groups) == -(-count // WRITE_GROUP)
        for _ in range(2):
            grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            opt(gradients(grads))
            values = [v - np.float32(0.25) * g for v, g in zip(values, grads)]
            for p, v in zip(params, values):
                assert p.shape == v.shape
                np.testing.assert_array_equal(p.asnumpy(), v)
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def test_the_train_step_applies_the_gradient_reducer():
    """The compiled step sums the gradients with the reducer it is given (in a data-parallel run
    MindSpore's nn.DistributedGradReducer): with a stand-in that doubles them (2 ranks with equal
    gradients), SGD moves every weight by lr x 2 g; without one, by lr x g."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant
    from orb.training.steps import TrainStep

    class TwoEqualRanks(nn.Cell):
        def __init__(self):
            super().__init__()
            self.hyper_map = ops.HyperMap()

        def construct(self, grads):
            return self.hyper_map(lambda g: g * 2.0, grads)

    class Linear(nn.Cell):  # loss = sum(w * x): its gradient is x
        num_sums = 1

        def __init__(self, params):
            super().__init__()
            self.params = ms.ParameterTuple(params)

        def current_stats(self):
            return ()

        def new_stats(self, *inputs):
            return (), ()

        def commit(self, stats, counts):
            return ()

        def construct(self, *xs):
            loss = 0.0
            for p, x in zip(self.params, xs):
                loss = loss + (p * x).sum()
            return loss, ops.zeros(1, ms.float32)

    ms.set_context(mode=ms.GRAPH_MODE)
    for reducer, factor in ((None, 1.0), (TwoEqualRanks(), 2.0)):
        values, params = make_params(np.random.default_rng(5))
        grads = [np.random.default_rng(6 + i).standard_normal(v.shape).astype(np.float32)
                 for i, v in enumerate(values)]
        step = TrainStep(Linear(params), FlatAdam(params, constant(0.1, 3), clip_mode="none", algorithm="sgd"),
                         reducer)
        inputs = [Tensor(g) for g in grads]  # then unused inputs: a step takes the 18 loss inputs by name
        step(*inputs, *[Tensor(np.zeros(1, np.float32))] * (18 - len(inputs)))
        for p, v, g in zip(params, values, grads):
            np.testing.assert_allclose(p.asnumpy(), v - 0.1 * factor * g, rtol=1e-6, atol=1e-6)


def torch_one_cycle(lr, total, pct=0.05):
    """PyTorch OneCycleLR(max_lr=10 lr, div_factor=10, final_div_factor=10, cos, two phases,
    cycle_momentum, base 0.85, max 0.95), written out: (lrs, momenta)."""
    warm = pct * total - 1
    lrs, moms = [], []
    for step in range(total):
        if step <= warm:
            p, (a, b), (ma, mb) = step / warm, (lr, 10 * lr), (0.95, 0.85)
        else:
            p, (a, b), (ma, mb) = (step - warm) / (total - 1 - warm), (10 * lr, lr / 10), (0.85, 0.95)
        lrs.append(b + (a - b) / 2 * (math.cos(math.pi * p) + 1))
        moms.append(mb + (ma - mb) / 2 * (math.cos(math.pi * p) + 1))
    return np.array(lrs), np.array(moms)


def test_one_cycle_matches_pytorch_and_survives_short_runs():
    for total in (1000, 54321):  # the formula step by step, to numpy's cos against math.cos (1 ulp where SIMD)
        sched = one_cycle(3e-4, total)
        lrs, moms = torch_one_cycle(3e-4, total)
        np.testing.assert_allclose(sched.lr, lrs, rtol=1e-15, atol=0)
        np.testing.assert_allclose(sched.beta1, moms, rtol=1e-15, atol=0)
    sched = one_cycle(3e-4, 1000)
    assert sched.lr.max() == pytest.approx(3e-3) and sched.beta1.min() == pytest.approx(0.85)
    assert sched.beta1[0] == pytest.approx(0.95) and sched.beta1[-1] == pytest.approx(0.95)
    for total in (1, 2, 20, 21):  # orb-models 0.4.2 divides by zero at 20 steps
        s = one_cycle(1e-3, total)
        assert len(s.lr) == total and np.all(np.isfinite(s.lr)) and np.all(s.lr > 0)


def test_a_one_step_run_trains_at_the_rate_asked_for():
    """A run of one step (a one-batch data set for one epoch) is at each schedule's start, lr, not its end lr/10."""
    for kind in ("one_cycle", "cosine", "constant"):
        s = make_schedule(kind, 1e-3, 1, 0.05)
        assert s.lr.tolist() == [1e-3], kind
    assert make_schedule("one_cycle", 1e-3, 1, 0.05).beta1.tolist() == [0.95]
    assert warmup_cosine(1e-3, 2, 0.5).lr.tolist() == [1e-3, 1e-3]  # one warm-up step, one decay step


def test_warmup_cosine_never_exceeds_lr():
    for total, fraction in ((200, 0.05), (54321, 0.1), (7, 0.0)):  # each step as the formula gives it
        s, warmup = warmup_cosine(1e-3, total, fraction), int(round(fraction * total))
        expected = [1e-3 * (k + 1) / warmup if k < warmup else
                    1e-3 / 10 + (1e-3 - 1e-3 / 10) / 2.0 * (math.cos(math.pi * ((k - warmup) / (total - warmup - 1)))
                                                            + 1.0)
                    for k in range(total)]
        np.testing.assert_allclose(s.lr, expected, rtol=1e-15, atol=0)
    s = warmup_cosine(1e-4, 200, 0.05)
    assert s.lr.max() == pytest.approx(1e-4) and s.lr[0] == pytest.approx(1e-5)
    assert s.lr[9] == pytest.approx(1e-4) and s.lr[-1] == pytest.approx(1e-5)
    assert np.all(np.diff(s.lr[10:]) <= 0) and np.all(s.beta1 == 0.9)
    for total in (1, 2, 3):
        assert np.all(np.isfinite(warmup_cosine(1e-3, total, 0.05).lr))
