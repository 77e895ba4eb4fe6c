"""Learning-rate schedules as per-step arrays (MindSpore optimizers index them by global step)."""

import math

import numpy as np


def one_cycle(lr: float, total_steps: int, warmup_fraction: float = 0.05, div_factor: float = 10.0,
              final_div_factor: float = 10.0) -> np.ndarray:
    """PyTorch ``OneCycleLR`` (cosine, two phases) as orb-models' fine-tuning uses it.

    Starts at ``lr``, rises to ``div_factor * lr`` over ``warmup_fraction`` of the steps and anneals
    to ``lr / final_div_factor``. Unlike the PyTorch scheduler it never divides by zero for short
    runs (a warm-up shorter than one step is skipped) and has no step limit.
    """
    if total_steps < 1:
        raise ValueError("total_steps must be at least 1")
    start, peak, end = lr, lr * div_factor, lr / final_div_factor
    warmup_end = float(warmup_fraction * total_steps) - 1.0  # PyTorch's phase boundary
    last = float(total_steps - 1)

    def anneal(a: float, b: float, pct: float) -> float:
        return b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1.0)

    out = np.empty(total_steps, dtype=np.float32)
    for step in range(total_steps):
        if warmup_end > 0 and step <= warmup_end:
            out[step] = anneal(start, peak, step / warmup_end)
        else:
            begin = max(warmup_end, 0.0)
            span = last - begin
            out[step] = anneal(peak, end, (step - begin) / span if span > 0 else 1.0)
    return out


def constant(lr: float, total_steps: int) -> np.ndarray:
    return np.full(max(total_steps, 1), lr, dtype=np.float32)


def learning_rates(kind: str, lr: float, total_steps: int, warmup_fraction: float) -> np.ndarray:
    if kind == "one_cycle":
        return one_cycle(lr, total_steps, warmup_fraction)
    if kind == "constant":
        return constant(lr, total_steps)
    raise ValueError(f"unknown lr_schedule {kind!r}")
