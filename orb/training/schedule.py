"""Per-step learning rates and Adam beta1 values, computed once on the host.

The compiled optimizer indexes these arrays by its step counter, so a schedule costs nothing per
step and a resumed run continues at exactly the same position.

* ``one_cycle``: orb-models' fine-tuning schedule, PyTorch ``OneCycleLR(max_lr=10 lr,
  pct_start=warmup_fraction, div_factor=10, final_div_factor=10, cycle_momentum=True)``: the rate
  rises from ``lr`` to 10 ``lr`` and anneals to ``lr / 10`` (cosine), while Adam's beta1 moves
  the opposite way, 0.95 -> 0.85 -> 0.95.
* ``cosine``: linear warm-up from 0 to ``lr`` over ``warmup_fraction`` of the steps, then cosine
  decay to ``lr / final_div``; beta1 constant. The peak is ``lr`` itself, so a pretrained model is
  never pushed by a rate larger than the one asked for (the default for fine-tuning).
* ``constant``: ``lr`` at every step.
"""

from typing import NamedTuple

import numpy as np

SCHEDULES = ("cosine", "one_cycle", "constant")
BETA1 = 0.9  # Adam's default, used by the schedules that do not cycle it
ONE_CYCLE_BETA1 = (0.85, 0.95)  # OneCycleLR's base_momentum, max_momentum


class Schedule(NamedTuple):
    lr: np.ndarray  # (steps,) float64
    beta1: np.ndarray  # (steps,) float64


def _cosine(a: float, b: float, pct: np.ndarray) -> np.ndarray:
    """PyTorch's _annealing_cos, element-wise: from a (pct 0) to b (pct 1). The same operations in the same order as
    its scalar form, so each step's value is the same float64 (tested against it)."""
    return b + (a - b) / 2.0 * (np.cos(np.pi * pct) + 1.0)


def one_cycle(lr: float, total_steps: int, warmup_fraction: float = 0.05, div_factor: float = 10.0,
              final_div_factor: float = 10.0) -> Schedule:
    """PyTorch ``OneCycleLR`` (two phases, cosine, momentum cycled) as orb-models' fine-tuning uses it.

    Unlike the PyTorch scheduler it never divides by zero for short runs (a warm-up shorter than
    one step is skipped), a run of one step trains at ``lr`` (PyTorch's would at ``lr / 10``, its end), and it
    has no step limit. Computed as arrays: a run of millions of steps (MPtrj for 20
    epochs: 3.95 M) starts without a per-step Python loop.
    """
    if total_steps < 1:
        raise ValueError("total_steps must be at least 1")
    start, peak, end = lr, lr * div_factor, lr / final_div_factor
    low, high = ONE_CYCLE_BETA1
    warmup_end = float(warmup_fraction * total_steps) - 1.0  # PyTorch's phase boundary
    last = float(total_steps - 1)
    steps = np.arange(total_steps, dtype=np.float64)
    begin = max(warmup_end, 0.0)
    span = last - begin
    if span <= 0:  # one step: the cycle's start, not its end
        return Schedule(np.full(total_steps, start), np.full(total_steps, high))
    pct = (steps - begin) / span
    lrs, betas = _cosine(peak, end, pct), _cosine(low, high, pct)
    if warmup_end > 0:
        warm = steps <= warmup_end
        pct = steps[warm] / warmup_end
        lrs[warm], betas[warm] = _cosine(start, peak, pct), _cosine(high, low, pct)
    return Schedule(lrs, betas)


def warmup_cosine(lr: float, total_steps: int, warmup_fraction: float = 0.05, final_div: float = 10.0) -> Schedule:
    """Linear warm-up to ``lr`` (the first step already trains at lr / warm-up steps), cosine to lr / final_div.

    A decay of one step (a one-step run) is at its start, ``lr``: its end, lr / final_div, would train a run
    too short for the schedule at a tenth of the rate asked for."""
    if total_steps < 1:
        raise ValueError("total_steps must be at least 1")
    warmup = min(int(round(warmup_fraction * total_steps)), total_steps)
    steps = np.arange(total_steps, dtype=np.float64)
    span = total_steps - warmup - 1
    pct = (steps[warmup:] - warmup) / span if span > 0 else np.zeros(total_steps - warmup)
    lrs = np.empty(total_steps)
    lrs[:warmup] = lr * (steps[:warmup] + 1) / warmup
    lrs[warmup:] = _cosine(lr, lr / final_div, pct)
    return Schedule(lrs, np.full(total_steps, BETA1))


def constant(lr: float, total_steps: int) -> Schedule:
    steps = max(total_steps, 1)
    return Schedule(np.full(steps, float(lr)), np.full(steps, BETA1))


def make_schedule(kind: str, lr: float, total_steps: int, warmup_fraction: float) -> Schedule:
    if kind == "one_cycle":
        return one_cycle(lr, total_steps, warmup_fraction)
    if kind == "cosine":
        return warmup_cosine(lr, total_steps, warmup_fraction)
    if kind == "constant":
        return constant(lr, total_steps)
    raise ValueError(f"unknown lr_schedule {kind!r}; expected one of {SCHEDULES}")
