"""The compiled training and evaluation steps (each a whole step in one graph-mode ``nn.Cell``)."""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.training.loss import NormalisedLoss
from orb.training.optimizer import FlatAdam


class TrainStep(nn.Cell):
    """One optimisation step: the normalisers' new statistics, loss and gradients, the statistics stored,
    then the optimizer (which sums the gradient over data-parallel ranks, clips and updates).

    Metric sums accumulate on the device in ``metric_sums`` (read and reset once per logging
    interval, so a step needs no host synchronisation).
    """

    def __init__(self, loss_cell: NormalisedLoss, optimizer: FlatAdam):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell
        self.optimizer = optimizer
        self.grad_fn = ms.value_and_grad(self.loss_cell, None, optimizer.params, has_aux=True)
        self.metric_sums = Parameter(Tensor(np.zeros(loss_cell.num_sums, np.float32)), name="train_metric_sums",
                                     requires_grad=False)

    def construct(self, *inputs):
        old = self.loss_cell.current_stats()
        new, counts = self.loss_cell.new_stats(*inputs)
        (loss, sums), grads = self.grad_fn(*inputs, *old, *new)
        loss = ops.depend(loss, self.loss_cell.commit(new, counts))
        loss = ops.depend(loss, self.optimizer(grads))
        return ops.depend(loss, ops.assign_add(self.metric_sums, sums))


class EvalStep(nn.Cell):
    """Loss and metric sums with frozen normalisers; returns the sums of this batch."""

    def __init__(self, loss_cell: NormalisedLoss):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell

    def construct(self, *inputs):
        stats = self.loss_cell.current_stats()
        _, sums = self.loss_cell(*inputs, *stats, *stats)
        return sums


def read_and_reset(sums: Parameter) -> np.ndarray:
    """Host copy (float64) of accumulated metric sums (one synchronisation), then zero them."""
    values = sums.asnumpy().astype(np.float64)
    sums.set_data(Tensor(np.zeros(sums.shape, np.float32)))
    return values
