"""An edge MLP's first layer finished per edge (``orb.models.blocks.EdgeInput``): the ``cpu`` profile's one-pass
kernel gives the composed form's values, gradient and second derivative (a conservative model's training) to the
bit; a graph traced for inputs of every size takes the composed form; the kernel fails loudly on an index outside
its table."""

import numpy as np
import pytest

EDGES, NODES, WIDTH = 300, 40, 24


def _inputs(seed=0, edges=EDGES):
    """(x, table, bias, senders, receivers): repeated senders, a node no edge reads, values of mixed magnitude."""
    rng = np.random.default_rng(seed)
    senders = rng.integers(0, NODES - 1, edges).astype(np.int32)  # node NODES - 1 sends nothing
    receivers = rng.integers(0, NODES, edges).astype(np.int32)
    scale = np.exp(rng.uniform(-4, 4, (1, 2 * WIDTH))).astype(np.float32)
    return (rng.standard_normal((edges, WIDTH)).astype(np.float32),
            (rng.standard_normal((NODES, 2 * WIDTH)) * scale).astype(np.float32),
            rng.standard_normal(WIDTH).astype(np.float32), senders, receivers)


def _cells(form):
    """(value, first-order, second-order) cells over the edge input: ``EdgeInput`` as a model builds it ("ours"), or
    the composed form alone."""
    from mindspore import nn, ops

    from orb.models import blocks
    from orb.models.kernels import library_path

    if library_path() is None:
        pytest.fail("no C++ compiler: the kernels cannot be built here")
    function = blocks.EdgeInput() if form == "ours" else blocks._ComposedEdgeInput()
    if form == "ours":
        assert function.kernel is not None  # (the cpu profile, the library built: the kernel is what is tested)

    class Energy(nn.Cell):
        def __init__(self):
            super().__init__()
            self.function = function

        def construct(self, x, table, bias, senders, receivers):
            return (ops.sin(self.function(x, table, bias, senders, receivers)) * 1.7).sum()

    class Gradient(nn.Cell):
        def __init__(self, of):
            super().__init__()
            self.of, self.grad = of, ops.GradOperation(get_all=True)

        def construct(self, x, table, bias, senders, receivers):
            return self.grad(self.of)(x, table, bias, senders, receivers)

    class Squared(nn.Cell):  # its gradient differentiates the edge input's gradient once more
        def __init__(self):
            super().__init__()
            self.gradient = Gradient(Energy())

        def construct(self, x, table, bias, senders, receivers):
            gx, gt, gb, _, _ = self.gradient(x, table, bias, senders, receivers)
            return (gx * gx).sum() + (gt * ops.cos(gt)).sum() + (gb * gb).sum()

    return function, Gradient(Energy()), Gradient(Squared())


def _outputs(cells, args):
    """The value, then each derivative cell's gradients in (x, table, bias)."""
    return [cells[0](*args)] + [g for cell in cells[1:] for g in cell(*args)[:3]]


@pytest.mark.parametrize("every_size", [False, True], ids=["one shape", "every size"])
def test_the_edge_input_gives_the_composed_forms_values_and_derivatives_to_the_bit(every_size):
    import contextlib

    import mindspore as ms
    from mindspore import Tensor

    from orb.precision import dynamic_shapes

    ms.set_context(mode=ms.GRAPH_MODE)
    ours, composed = _cells("ours"), _cells("composed")
    if every_size:  # (a prediction's graph: the value and its gradient)
        ours = ours[:2]
        unknown = [Tensor(shape=[None, WIDTH], dtype=ms.float32), Tensor(shape=[None, 2 * WIDTH], dtype=ms.float32),
                   Tensor(shape=[WIDTH], dtype=ms.float32), Tensor(shape=[None], dtype=ms.int32),
                   Tensor(shape=[None], dtype=ms.int32)]
        for cell in ours:
            cell.set_inputs(*unknown)
    with dynamic_shapes() if every_size else contextlib.nullcontext():
        for seed, edges in ((0, EDGES), (1, 77)):
            args = [Tensor(a) for a in _inputs(seed, edges)]
            got, expected = _outputs(ours, args), _outputs(composed, args)
            assert len(got) == (4 if every_size else 7)
            for k, (a, b) in enumerate(zip(got, expected)):
                a, b = a.asnumpy(), b.asnumpy()
                assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)), (seed, k)
            assert np.abs(got[-1].asnumpy()).max() > 0  # (derivatives that are not all zeros)
    x, table, bias, senders, receivers = _inputs(0)
    numpy = (x + (table[senders, :WIDTH] + bias)) + table[receivers, WIDTH:]  # the same operations, in order
    np.testing.assert_array_equal(_outputs(composed, [Tensor(a) for a in (x, table, bias, senders, receivers)])[0]
                                  .asnumpy(), numpy)


def test_an_index_outside_the_table_or_another_type_fails_the_kernel():
    """Each case in a cell of its own: MindSpore refuses every later call of a cell whose kernel failed once."""
    import mindspore as ms
    from mindspore import Tensor

    from orb.models import blocks
    from orb.models.kernels import library_path

    ms.set_context(mode=ms.GRAPH_MODE)
    x, table, bias, senders, receivers = _inputs(0)
    past_the_end, negative = (np.where(np.arange(EDGES) == k, v, senders).astype(np.int32) for k, v in ((7, NODES),
                                                                                                        (3, -1)))
    for bad in ((x, table, bias, past_the_end, receivers), (x, table, bias, senders, negative),
                (x, table, bias, senders.astype(np.int64), receivers), (x.astype(np.float16), table, bias, senders,
                                                                         receivers)):
        cell = blocks._KernelEdgeInput(library_path())
        with pytest.raises(RuntimeError, match="OrbEdgeInput"):
            cell(*[Tensor(a) for a in bad]).asnumpy()
    good = blocks._KernelEdgeInput(library_path())(*[Tensor(a) for a in (x, table, bias, senders, receivers)])
    assert np.isfinite(good.asnumpy()).all()


def test_a_models_training_step_and_predictions_are_the_same_bits_with_the_kernel_as_without():
    """The kernel where the model uses it (``AttentionInteraction``: its arguments' order, the table's halves):
    two training steps of a conservative model (which differentiate its forces once more) and its predictions after
    them give the same bits as the same model with the composed form. (orb-v2's layers are the same cell.)"""
    import mindspore as ms

    from conftest import DEMO_TRAIN, SMALL_MODEL
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.buckets import Bucket
    from orb.data.dataset import AseDbDataset
    from orb.data.tensors import loss_arrays
    from orb.inference.predictor import Predictor
    from orb.models import create
    from orb.models.blocks import EdgeInput
    from orb.training.config import config_from_dict
    from orb.training.distributed import DataParallel
    from orb.training.engine import Engine

    ms.set_context(mode=ms.GRAPH_MODE)
    name = "orb_v3_conservative_20_omat"
    data = AseDbDataset(DEMO_TRAIN)
    bucket = Bucket(64, 1280, 5)
    batches = [pad_batch(batch_graphs([data.get(i) for i in rows]), bucket.num_nodes, bucket.num_edges,
                         bucket.num_graphs) for rows in ((0, 1, 2, 3), (4, 5, 6, 7))]
    results = []
    for kernel in (True, False):
        cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, device_target="CPU", lr_schedule="constant",
                                    model=dict(SMALL_MODEL, name=name)))
        model = create(name, seed=1, **SMALL_MODEL)
        inputs = [cell for _, cell in model.cells_and_names() if isinstance(cell, EdgeInput)]
        assert len(inputs) == SMALL_MODEL["num_message_passing_steps"] and all(c.kernel is not None for c in inputs)
        if not kernel:
            for cell in inputs:
                cell.kernel = None
        engine = Engine(model, cfg, DataParallel(), True, 10)
        for batch in batches:
            engine.train(loss_arrays(batch), bucket)
        predicted = Predictor(model, reuse=False)(batches[0])
        results.append({**{p.name: p.asnumpy() for p in model.get_parameters()}, **predicted})
    ours, composed = results
    assert ours.keys() == composed.keys() and {"energy", "forces"} <= set(ours)
    for key in ours:
        np.testing.assert_array_equal(ours[key], composed[key], err_msg=key)


def test_compiled_memory_is_recycled_after_a_cell_with_a_bprop_of_its_own_is_freed():
    """MindSpore's ``ms_memory_recycle`` raised "dictionary changed size during iteration" once such a cell (the
    kernel form here) was freed (tests/conftest.py's release between test files; benchmark.py compile-memory)."""
    import gc

    import mindspore as ms
    from mindspore import Tensor

    from orb.device import recycle_compiled_memory
    from orb.models import blocks
    from orb.models.kernels import library_path

    ms.set_context(mode=ms.GRAPH_MODE)
    args = [Tensor(a) for a in _inputs(0)]
    for _ in range(3):
        assert np.isfinite(blocks._KernelEdgeInput(library_path())(*args).asnumpy()).all()
    gc.collect()
    recycle_compiled_memory()
    again = blocks._KernelEdgeInput(library_path())(*args).asnumpy()  # (and what comes after still compiles and runs)
    assert np.array_equal(again, blocks._ComposedEdgeInput()(*args).asnumpy())
