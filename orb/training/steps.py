"""The compiled training and evaluation steps (each a whole step in one graph-mode ``nn.Cell``)."""

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.training.loss_base import NormalisedLoss
from orb.training.optimizer import FlatAdam


class TrainStep(nn.Cell):
    """One optimisation step: the normalisers' new statistics, loss and gradients, the gradients summed over
    data-parallel ranks by ``grad_reducer`` (MindSpore's ``nn.DistributedGradReducer`` in a data-parallel run,
    the optimizer's reduce-scatter when it is sharded, none on one device), then -- if the gradient is finite --
    the statistics stored and the optimizer's update.

    A step whose gradient holds a NaN or inf (a diverging run, a broken structure) changes nothing
    and is counted instead: ``nonfinite`` holds [such steps in a row now, the longest run of them
    since the last read, the number of the latest one, how many since the last read] (every rank
    decides alike: the gradient is the reduced one). Metric sums of the finite steps accumulate on
    the device in ``metric_sums``. Both are read once per logging interval, so a step needs no host
    synchronisation.
    """

    def __init__(self, loss_cell: NormalisedLoss, optimizer: FlatAdam, grad_reducer: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell
        self.optimizer = optimizer
        self.grad_fn = ms.value_and_grad(self.loss_cell, None, optimizer.params, has_aux=True)
        self.grad_reducer = grad_reducer
        self.metric_sums = Parameter(Tensor(np.zeros(loss_cell.num_sums, np.float32)), name="train_metric_sums",
                                     requires_grad=False)
        self.nonfinite = Parameter(Tensor(np.zeros(4, np.int32)), name="train_nonfinite_steps", requires_grad=False)
        self.steps_run = Parameter(Tensor(np.array(0, np.int32)), name="train_steps_run", requires_grad=False)
        self.after_finite_step = Tensor(np.array([0, 1, 1, 1], np.int32))  # a finite step ends the run in a row

    def construct(self, *inputs):
        old = self.loss_cell.current_stats()
        new, counts = self.loss_cell.new_stats(*inputs)
        (loss, sums), grads = self.grad_fn(*inputs, *old, *new)
        if self.grad_reducer is not None:
            grads = self.grad_reducer(self.optimizer.prepare_for_reduction(grads))
        grad, finite, norm = self.optimizer.flat_gradient(grads)
        loss = ops.depend(loss, ops.assign_add(self.steps_run, ops.ones((), ms.int32)))
        if finite:
            loss = ops.depend(loss, self.loss_cell.commit(new, counts))
            loss = ops.depend(loss, self.optimizer.apply(grad, norm))
            loss = ops.depend(loss, ops.assign_add(self.metric_sums, sums))
            loss = ops.depend(loss, ops.assign(self.nonfinite, self.nonfinite * self.after_finite_step))
        else:
            row = self.nonfinite[0] + 1
            loss = ops.depend(loss, ops.assign(self.nonfinite, ops.stack(
                (row, ops.maximum(row, self.nonfinite[1]), self.steps_run, self.nonfinite[3] + 1))))
        return loss


class EvalStep(nn.Cell):
    """Loss and metric sums with frozen normalisers; returns the sums of this batch."""

    def __init__(self, loss_cell: NormalisedLoss):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell

    def construct(self, *inputs):
        stats = self.loss_cell.current_stats()
        _, sums = self.loss_cell(*inputs, *stats, *stats)
        return sums


def write_parameter(param: Parameter, value: np.ndarray) -> None:
    """Overwrite a parameter that compiled steps use, in place: after a graph with branches has run, MindSpore
    2.10's ``set_data`` swaps the buffer and the branches' writes go to the old one (measured)."""
    ops.assign(param, Tensor(np.asarray(value, dtype=param.asnumpy().dtype).reshape(param.shape)))


def read_and_reset(sums: Parameter) -> np.ndarray:
    """Host copy (float64) of accumulated metric sums (one synchronisation), then zero them."""
    values = sums.asnumpy().astype(np.float64)
    write_parameter(sums, np.zeros(sums.shape))
    return values


def read_nonfinite(step: TrainStep) -> np.ndarray:
    """[non-finite steps in a row now, the longest such run since the last read, the latest one's number (1-based,
    counted from this process's first step), how many since the last read]; the last two counts restart."""
    values = step.nonfinite.asnumpy().astype(np.int64)
    write_parameter(step.nonfinite, np.array([values[0], values[0], values[2], 0]))
    return values
