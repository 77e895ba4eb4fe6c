"""The compiled training and evaluation steps (whole step in one graph-mode ``nn.Cell``)."""

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.training.loss import SUM_KEYS, OrbLoss


def clip_gradients(grads, mode: str, value: float):
    """'value': element-wise clamp to [-value, value] (orb-models 0.4.2); 'norm': global L2 norm; 'none'."""
    if mode == "value":
        return tuple(ops.clamp(g, -value, value) for g in grads)
    if mode == "norm":
        return ops.clip_by_global_norm(grads, value)
    return grads


class TrainStep(nn.Cell):
    """One optimisation step: normaliser update, loss and gradients, (all-)reduce, clip, optimizer.

    Metric sums accumulate on the device in ``metric_sums`` (read and reset once per logging
    interval, so a step needs no host synchronisation).
    """

    def __init__(self, loss_cell: OrbLoss, optimizer: nn.Optimizer, clip_mode: str = "value",
                 clip_value: float = 0.5, grad_reducer: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.grad_fn = ms.value_and_grad(self.loss_cell, None, self.weights, has_aux=True)
        self.grad_reducer = grad_reducer
        self.clip_mode = clip_mode
        self.clip_value = float(clip_value)
        self.metric_sums = Parameter(Tensor(np.zeros(len(SUM_KEYS), np.float32)), name="train_metric_sums",
                                     requires_grad=False)

    def construct(self, *inputs):
        stats = self.loss_cell.update_stats(*inputs)
        (loss, sums), grads = self.grad_fn(*inputs, *stats)
        if self.grad_reducer is not None:
            grads = self.grad_reducer(grads)
        grads = clip_gradients(grads, self.clip_mode, self.clip_value)
        loss = ops.depend(loss, self.optimizer(grads))
        ops.assign_add(self.metric_sums, sums)
        return loss


class EvalStep(nn.Cell):
    """Loss metrics with frozen normalisers, accumulated into ``metric_sums``."""

    def __init__(self, loss_cell: OrbLoss):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell
        self.metric_sums = Parameter(Tensor(np.zeros(len(SUM_KEYS), np.float32)), name="eval_metric_sums",
                                     requires_grad=False)

    def construct(self, *inputs):
        loss, sums = self.loss_cell(*inputs, *self.loss_cell.current_stats())
        ops.assign_add(self.metric_sums, sums)
        return loss


def read_and_reset(sums: Parameter) -> np.ndarray:
    """Host copy of accumulated metric sums (one synchronisation), then zero them."""
    values = sums.asnumpy().astype(np.float64)
    sums.set_data(Tensor(np.zeros(sums.shape, np.float32)))
    return values
