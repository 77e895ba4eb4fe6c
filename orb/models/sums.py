"""Sums whose length grows with the structure or the data, accurate to the float32 rounding of their result.

A float32 sum of n terms, accumulated one after another, rounds n times: its error grows with n (the mean of 8,192
atoms' latents moved a cell's energy by 60 float32 ulps of its total) and with the order of the terms (the atoms'
order). Every sum over a structure's atoms or edges into one value per structure, and every sum over a batch's
structures or atoms (metrics, normaliser statistics), goes through :func:`segment_total` or :func:`total`:

* where the device computes in float64 (the CPU; GPU), float32 values are summed in float64 and rounded once;
* on Ascend, which has little float64, each value is split into a multiple of a power-of-two grid and a remainder
  below half the grid (:func:`split_sum`): the grid parts sum exactly in float32 in any order (the device's
  kernels choose their own), only the small remainders round.

A float64 model sums in float64 as it is. Sums whose length is bounded (messages over one atom's edges, a 3 x 3
product) stay plain. docs/numerics.md says what each sum does.

Every segment sum goes through :func:`scatter_sum`, which in a graph traced for inputs of any size
(:func:`orb.precision.dynamic_shapes`) adds the rows into zeros with ``TensorScatterAdd``: there the count of
segments is known only when the graph runs, and MindSpore 2.10's CPU ``UnsortedSegmentSum`` refuses it.
"""

import math

import numpy as np
from mindspore import Tensor, ops
import mindspore as ms

from orb.precision import sum_form, traced_for_every_size

_GRID_EXPONENTS = (-120, 120)  # float32 normal range, with room for the grid's margin
_POWERS = Tensor(np.ldexp(np.float32(1.0), np.arange(_GRID_EXPONENTS[0], _GRID_EXPONENTS[1] + 1)).astype(np.float32))
_INVERSE_POWERS = Tensor(np.ldexp(np.float32(1.0), -np.arange(_GRID_EXPONENTS[0],
                                                               _GRID_EXPONENTS[1] + 1)).astype(np.float32))
_INV_LN2 = 1.0 / math.log(2.0)


def scatter_sum(data: Tensor, segment_ids: Tensor, num_segments) -> Tensor:
    """Rows of ``data`` summed per segment in the data's type (``ops.unsorted_segment_sum``); in a graph traced under
    :func:`orb.precision.dynamic_shapes`, added into zeros of ``num_segments`` rows (a length known only at run time)."""
    if traced_for_every_size():
        return ops.tensor_scatter_add(ops.zeros((num_segments,) + data.shape[1:], data.dtype),
                                      segment_ids.reshape(-1, 1), data)
    return ops.unsorted_segment_sum(data, segment_ids, num_segments)


def segment_total(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Rows of ``data`` summed per segment (``ops.unsorted_segment_sum``), accurate to the rounding of each result
    whatever the number and order of the rows. Its gradient is the plain one (each row gets its segment's)."""
    if data.dtype == ms.float64:
        return scatter_sum(data, segment_ids, num_segments)
    if sum_form() == "split":
        return split_sum(data, segment_ids, num_segments)
    return scatter_sum(data.astype(ms.float64), segment_ids, num_segments).astype(data.dtype)


def total(data: Tensor) -> Tensor:
    """The sum of every element of ``data`` (a scalar), as :func:`segment_total`."""
    flat = data.reshape(-1)
    return segment_total(flat, ops.zeros(flat.shape, ms.int32), 1).reshape(())


def column_totals(data: Tensor) -> Tensor:
    """(rows, cols) -> (cols,): each column's sum, as :func:`segment_total`."""
    return segment_total(data, ops.zeros(data.shape[:1], ms.int32), 1).reshape(-1)


def split_sum(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """float32 segment sums whose grid parts are exact in any order (Ascend's form, tested on the CPU).

    Per segment and column, with m the largest |value| and n the rows of ``data``: a power of two g1 in
    (n m 2^-23, n m 2^-21] splits each value x exactly into q1 = g1 round(x / g1) and a remainder below g1 / 2, which
    g2 = g1 2^(ceil(log2 n) - 24) splits again. Every partial sum of the q1 (or of the q2) is a multiple of g1 (g2)
    below 2^24 g1 (g2), hence exact in any order; only the last remainders (below n^2 m 2^-45 each) round. The three
    sums are added smallest first. The gradient flows through the last remainders (1 per row, a plain sum's).
    """
    magnitude = ops.abs(ops.stop_gradient(data))
    largest = ops.gather(ops.unsorted_segment_max(magnitude, segment_ids, num_segments), segment_ids, 0)
    rows = ops.ones((), data.dtype) * float(data.shape[0])
    exponent = ops.floor(ops.log(ops.maximum(largest * rows, 1e-30)) * _INV_LN2) - 21.0  # >= log2(n m) - 23
    coarsening = ops.ceil(ops.log(rows) * _INV_LN2) - 24.0  # (a log2 rounded up only makes g2 coarser: still exact)
    rest, parts = data, []
    for level in (exponent, exponent + coarsening):
        index = (ops.clamp(level, float(_GRID_EXPONENTS[0]), float(_GRID_EXPONENTS[1]))
                 - float(_GRID_EXPONENTS[0])).astype(ms.int32)
        on_grid = ops.stop_gradient(ops.round(rest * ops.gather(_INVERSE_POWERS, index, 0))
                                    * ops.gather(_POWERS, index, 0))
        parts.append(scatter_sum(on_grid, segment_ids, num_segments))
        rest = rest - on_grid
    return (scatter_sum(rest, segment_ids, num_segments) + parts[1]) + parts[0]


def segment_mean(data: Tensor, segment_ids: Tensor, counts: Tensor) -> Tensor:
    """Mean of rows per segment (:func:`segment_total` divided by ``counts`` (S,) float); empty segments give 0."""
    sums = segment_total(data, segment_ids, counts.shape[0])
    denominator = ops.maximum(counts, 1.0)
    return sums / denominator.reshape((-1,) + (1,) * (sums.ndim - 1))


def gather_per_segment(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` for per-structure ``values`` (a strain, a cell) that every atom or edge reads. Its gradient
    is a sum over each structure's atoms or edges (a conservative model's virial): in float64 where the device has
    it (the gather runs on float64 values, the result is the same float32). On Ascend the device's float32 sum
    (a custom backward here breaks the double backward of training)."""
    if values.dtype == ms.float64 or sum_form() == "split":
        return ops.gather(values, index, 0)
    return ops.gather(values.astype(ms.float64), index, 0).astype(values.dtype)
