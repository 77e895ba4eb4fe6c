"""The compiled training and evaluation steps (each a whole step in one graph-mode ``nn.Cell``)."""

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.graph_cache import CompiledThroughCache
from orb.training.loss_base import NormalisedLoss
from orb.training.optimizer import FlatAdam

# LEAK_FREE_CALLS: the steps take their inputs by name. In MindSpore 2.10 a compiled ``construct(self, *inputs)``
# that calls a cell (or its gradient) with ``*inputs`` keeps that cell, and with it the model, its weights and its
# compiled graphs, alive for the rest of the process (measured: every trainer or calculator built in one Python
# session stayed in memory; a full-size orb-v2 calculator 110 MB each). Unpacking a tuple built inside is safe.


class TrainStep(CompiledThroughCache, nn.Cell):
    """One optimisation step: the normalisers' new statistics, loss and gradients, the gradients summed over
    data-parallel ranks by ``grad_reducer`` (MindSpore's ``nn.DistributedGradReducer`` in a data-parallel run,
    the optimizer's reduce-scatter when it is sharded, none on one device), then -- if the gradient is finite --
    the statistics stored and the optimizer's update.

    A step whose gradient holds a NaN or inf (a diverging run, a broken structure) changes nothing
    and is counted instead: ``nonfinite`` holds [such steps in a row now, the longest run of them
    since the last read, the number of the latest one, how many since the last read] (every rank
    decides alike: the gradient is the reduced one). Metric sums of the finite steps accumulate on
    the device in ``metric_sums`` (float64 where the device has it: :func:`metric_sum_type`). Both are read
    once per logging interval, so a step needs no host synchronisation.
    """

    def __init__(self, loss_cell: NormalisedLoss, optimizer: FlatAdam, grad_reducer: Optional[nn.Cell] = None,
                 loss_scale: Optional["LossScale"] = None):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        scaled = loss_cell if loss_scale is None else ScaledLoss(loss_cell, loss_scale)
        self.grad_fn = ms.value_and_grad(scaled, None, optimizer.params, has_aux=True)
        self.grad_reducer = grad_reducer
        self.metric_sums = Parameter(Tensor(np.zeros(loss_cell.num_sums, metric_sum_type(optimizer.real))),
                                     name="train_metric_sums", requires_grad=False)
        self.nonfinite = Parameter(Tensor(np.zeros(4, np.int32)), name="train_nonfinite_steps", requires_grad=False)
        self.steps_run = Parameter(Tensor(np.array(0, np.int32)), name="train_steps_run", requires_grad=False)
        self.after_finite_step = Tensor(np.array([0, 1, 1, 1], np.int32))  # a finite step ends the run in a row

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress):
        inputs = (numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress)
        old = self.loss_cell.current_stats()
        new, counts = self.loss_cell.new_stats(*inputs)
        if self.loss_scale is None:
            (loss, sums), grads = self.grad_fn(*inputs, *old, *new)
        else:
            (loss, sums), grads = self.grad_fn(*inputs, old, new)
        if self.grad_reducer is not None:
            grads = self.grad_reducer(self.optimizer.prepare_for_reduction(grads))
        grad, finite, norm = self.optimizer.flat_gradient(grads)
        loss = ops.depend(loss, ops.assign_add(self.steps_run, ops.ones((), ms.int32)))
        if self.loss_scale is not None:  # the gradient of the scaled loss, unscaled
            scale = self.loss_scale.scale + 0.0
            grad, norm = grad / scale, norm / scale
        if finite:
            loss = ops.depend(loss, self.loss_cell.commit(new, counts))
            loss = ops.depend(loss, self.optimizer.apply(grad, norm))
            loss = ops.depend(loss, ops.assign_add(self.metric_sums, sums.astype(self.metric_sums.dtype)))
            loss = ops.depend(loss, ops.assign(self.nonfinite, self.nonfinite * self.after_finite_step))
            if self.loss_scale is not None:
                loss = ops.depend(loss, self.loss_scale.after_finite())
        elif self.loss_scale is not None and self.loss_scale.can_lower():
            loss = ops.depend(loss, self.loss_scale.lower())  # an fp16 overflow: not a divergence
        else:
            in_a_row, longest, _, count = ops.unstack(self.nonfinite + 0)
            row = in_a_row + 1
            loss = ops.depend(loss, ops.assign(self.nonfinite, ops.stack(
                (row, ops.maximum(row, longest), self.steps_run, count + 1))))
        return loss


def metric_sum_type(real):
    """The type the training metric sums accumulate in over a logging interval (many steps): float64 where the
    device computes it (:func:`orb.precision.sum_form`), else the model's float type."""
    from orb.precision import sum_form

    return np.float64 if sum_form() == "float64" else real


class LossScale(nn.Cell):
    """Dynamic loss scaling for ``fp16-mixed`` training: the loss is multiplied by ``scale`` before the gradient (so
    float16 products keep small gradients above float16's underflow), the gradient divided by it after. A step
    whose scaled gradient overflows is skipped and halves the scale (down to ``minimum``; at the minimum an
    overflow is an ordinary non-finite step, and those stop a diverging run); ``growth_interval`` finite steps in a
    row double it. ``overflows`` counts the skipped steps since the last read."""

    def __init__(self, initial: float = 2.0 ** 16, growth_interval: int = 2000, minimum: float = 1.0):
        super().__init__()
        self.scale = Parameter(Tensor(np.array(initial, np.float32)), name="loss_scale", requires_grad=False)
        self.good_steps = Parameter(Tensor(np.array(0, np.int32)), name="loss_scale_good_steps", requires_grad=False)
        self.overflows = Parameter(Tensor(np.array(0, np.int32)), name="loss_scale_overflows", requires_grad=False)
        self.growth_interval, self.minimum = growth_interval, minimum

    def can_lower(self):
        return self.scale > self.minimum

    def lower(self):
        done = ops.assign(self.scale, ops.maximum(self.scale / 2.0, self.minimum))
        done = ops.depend(done, ops.assign(self.good_steps, ops.zeros((), ms.int32)))
        return ops.depend(done, ops.assign_add(self.overflows, ops.ones((), ms.int32)))

    def after_finite(self):
        good = self.good_steps + 1
        grow = good >= self.growth_interval
        done = ops.assign(self.scale, ops.select(grow, self.scale * 2.0, self.scale))
        return ops.depend(done, ops.assign(self.good_steps, ops.select(grow, ops.zeros((), ms.int32), good)))


class ScaledLoss(nn.Cell):
    """A loss cell's loss times the loss scale (its metric sums unchanged), for the gradient of fp16 training. The
    statistics come as two tuples (``old``, ``new``): see LEAK_FREE_CALLS."""

    def __init__(self, loss_cell: NormalisedLoss, loss_scale: LossScale):
        super().__init__(auto_prefix=False)
        self.loss_cell, self.loss_scale = loss_cell, loss_scale

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress, old, new):
        loss, sums = self.loss_cell(numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic,
                                    cell, unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces,
                                    stress, *old, *new)
        return loss * ops.stop_gradient(self.loss_scale.scale), sums


class EvalStep(CompiledThroughCache, nn.Cell):
    """Loss and metric sums with frozen normalisers; returns the sums of this batch."""

    def __init__(self, loss_cell: NormalisedLoss):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress):
        inputs = (numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress)
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


def read_overflows(step: TrainStep) -> int:
    """fp16 loss-scale overflows (skipped steps) since the last read, then zero; 0 without loss scaling."""
    if step.loss_scale is None:
        return 0
    value = int(step.loss_scale.overflows.asnumpy())
    write_parameter(step.loss_scale.overflows, np.zeros(()))
    return value


def read_nonfinite(step: TrainStep) -> np.ndarray:
    """[non-finite steps in a row now, the longest such run since the last read, the latest one's number (1-based,
    counted from this process's first step), how many since the last read]; the last two counts restart."""
    values = step.nonfinite.asnumpy().astype(np.int64)
    write_parameter(step.nonfinite, np.array([values[0], values[0], values[2], 0]))
    return values
