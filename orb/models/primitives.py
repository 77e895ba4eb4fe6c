"""The primitives whose form the operator profile chooses (``orb.models.ops_profile``): broadcasts and
reductions of 2-D tensors, as a cell each model part builds, and the ``cpu`` profile's forms of them."""

from mindspore import Tensor, nn, ops

from orb.device import ops_profile

# The ``cpu`` profile's primitives -- MindSpore 2.10's CPU kernels, measured:
# reductions (ReduceSum/ReduceMean) and binary operators that broadcast (x + bias, x * column) each
# keep host index/work buffers of 8-16 bytes per element of their input for the life of the compiled
# graph (22 MB per kernel on a 2720 x 512 activation, measured with heaptrack); over orb's 15 layers,
# forward and backward, that was ~3 GB. So large activations are reduced by matrix products with a
# ones vector, biases are added with BiasAdd and other operands are expanded to the full shape first.
# Neither BroadcastTo (CPU kernel: 1.5 ms for a 1776 x 256 float32 result, 12 % of an orb-v2 training
# step) nor Tile (its gradient is a ReduceSum: 3 % of a conservative orb-v3 step): a product is as fast
# as Tile and its gradient is a matrix product too.
#
# The MatMul primitive, not functional ops.matmul: the gradient of ops.matmul (MatMulExt)
# transposes its operands with Transpose kernels where MatMul's gradient uses its transpose flags
# (8 % of a conservative orb-v3 training step, which differentiates the hand-written backward passes
# once more). A primitive instance also avoids a MindSpore 2.10 failure seen with functional ops.tile
# inside a custom bprop ("func graph is empty" on recompilation).
MATMUL = ops.MatMul()


def cpu_column(x: Tensor, width: int) -> Tensor:
    """(rows, 1) -> (rows, width) as x @ ones(1, width) (``cpu`` profile)."""
    return MATMUL(x, ops.ones((1, width), x.dtype))


def cpu_row(x: Tensor, height: int) -> Tensor:
    """(width,) -> (height, width) as ones(height, 1) @ x (``cpu`` profile)."""
    return MATMUL(ops.ones((height, 1), x.dtype), x.reshape(1, -1))


def cpu_row_sum(x: Tensor) -> Tensor:
    """(rows, cols) -> (rows, 1) as x @ ones(cols, 1) (``cpu`` profile)."""
    return MATMUL(x, ops.ones((x.shape[-1], 1), x.dtype))


def cpu_row_mean(x: Tensor) -> Tensor:
    return cpu_row_sum(x) * (1.0 / x.shape[-1])


def cpu_column_sum(x: Tensor) -> Tensor:
    """(rows, cols) -> (cols,) as ones(1, rows) @ x (``cpu`` profile)."""
    return MATMUL(ops.ones((1, x.shape[0]), x.dtype), x).reshape(-1)


class Broadcasts(nn.Cell):
    """Broadcasts and reductions of 2-D tensors in the profile chosen when this cell is built.

    Results have the same shapes in both profiles. ``portable``: ``BroadcastTo`` and ``ReduceSum``,
    with their framework gradients. Broadcasts are explicit (``BroadcastTo``, then an element-wise
    operator on equal shapes) rather than implicit in the arithmetic: MindSpore 2.10's CPU binary
    kernels keep per-element host buffers when they broadcast (an orb-v3 forward pass: 10.4 GB
    implicit, 4.7 GB explicit); on Ascend an explicit ``BroadcastTo`` is one more small element-wise
    kernel, which graph-kernel fusion may merge into its consumer (not measured: no NPU here). ``cpu``:
    products with a ones vector, as fast as ``Tile`` on MindSpore's CPU kernels, with a matrix
    product as gradient and no per-element host buffers.
    """

    def __init__(self):
        super().__init__()
        self.cpu = ops_profile() == "cpu"

    def column(self, x, width: int):
        """A (rows, 1) column repeated to (rows, width)."""
        if self.cpu:
            return cpu_column(x, width)
        return ops.broadcast_to(x, (x.shape[0], width))

    def row(self, x, height: int):
        """A (width,) vector repeated to (height, width)."""
        if self.cpu:
            return cpu_row(x, height)
        return ops.broadcast_to(x.reshape(1, -1), (height, x.shape[-1]))

    def row_sum(self, x):
        """(rows, cols) -> (rows, 1)."""
        if self.cpu:
            return cpu_row_sum(x)
        return x.sum(axis=-1, keepdims=True)

    def column_sum(self, x):
        """(rows, cols) -> (cols,)."""
        if self.cpu:
            return cpu_column_sum(x)
        return x.sum(axis=0)

    def scale(self, x, factor):
        """A tensor times a scalar tensor (shape ()): ``portable`` multiplies by the scalar (no copy of its size;
        on CPU it costs the per-element buffers, e.g. norm clipping of a 25 M-element gradient), ``cpu`` by a
        ``Tile`` of it (no broadcasting kernel)."""
        if self.cpu:
            return x * ops.tile(factor.reshape((1,) * x.ndim), x.shape)
        return x * factor
