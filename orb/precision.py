"""Numeric precision: what a model computes its matrix products (and, for ``float64``, everything) in.

Names as orb-models uses them (``precision=`` of its loaders), plus the two mixed modes of accelerators:

* ``float32-high`` (default, orb-models' own): float32, with matrix products in HF32 on Ascend and TF32 on
  GPU (10-bit-mantissa operands, float32 accumulation); float32 on the CPU.
* ``float32-highest``: float32 throughout (the parity references' arithmetic).
* ``bf16-mixed`` / ``fp16-mixed``: the operands of every matrix product of the networks' linear layers
  rounded to bfloat16 / float16, products accumulated in float32 and their results rounded to the half
  type, as the NPU's cube unit computes; the gradients reaching them likewise. Everything else stays
  float32: parameters (master weights), optimizer state, EMA, normalisers, the loss, biases, activations
  and layer/RMS-norm statistics, message aggregation and per-graph energy sums (those over a structure's
  atoms accumulated as in float32 mode: docs/numerics.md), edge vectors and distances, pair repulsion and
  the conservative models' force and stress derivatives (all of them sums or differences whose
  cancellation a half type would decide; measured in docs/benchmarks.md, ``benchmark.py precision``).
  Checkpoints stay float32, interchangeable between modes.
* ``float64``: parameters, inputs and every operation in float64 (CPU; phonons, elastic constants,
  tight relaxations).

On the CPU ``bf16-mixed`` is emulated (MindSpore 2.10 has no CPU bfloat16 MatMul): operands and results are
rounded to bfloat16 by a cast there and back, products computed in float32 -- the same numbers as the cube
unit's bfloat16 products with float32 accumulation, for checking fidelity, not for speed. ``fp16-mixed``
runs natively on the CPU and on accelerators. ``float64`` is refused on Ascend (no float64 cube
arithmetic).

Like the operator profile (:mod:`orb.models.ops_profile`), the precision in force when a cell is built is
the one it computes in.
"""

import threading
from contextlib import contextmanager
from typing import Optional

import numpy as np

from orb.errors import ConfigError

PRECISIONS = ("float32-high", "float32-highest", "bf16-mixed", "fp16-mixed", "float64")
DEFAULT = "float32-high"
_configured = {"name": DEFAULT}


def check_precision(name: str, source: str = "precision") -> str:
    if name not in PRECISIONS:
        raise ConfigError(f"{source} must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return name


def check_device(name: str, device_target: str) -> None:
    """Refuse a precision the device cannot run (one line naming what to use instead)."""
    if name == "float64" and device_target == "Ascend":
        raise ConfigError("precision float64 cannot run on Ascend (no float64 matrix arithmetic): use "
                          "float32-highest there, or float64 on the CPU")


def describe(name: str, device_target: str) -> str:
    """For start-up logs: the precision, and when it runs only emulated, that it is for checking numerics."""
    if name == "bf16-mixed" and device_target == "CPU":
        return ("precision bf16-mixed, emulated on the CPU (bfloat16 rounding, float32 arithmetic: for checking "
                "numerics, not for speed; native on Ascend)")
    return f"precision {name}"


def set_precision(name: str) -> None:
    """The precision of cells built from now on."""
    _configured["name"] = check_precision(name)


def precision() -> str:
    return _configured["name"]


@contextmanager
def in_force(name: str):
    """Models built inside compute in precision ``name``; the precision in force before comes back after."""
    before = precision()
    set_precision(name)
    try:
        yield
    finally:
        set_precision(before)


# the form of long float32 sums (:mod:`orb.models.sums`): "float64" (CPU, GPU) or "split" (Ascend); set when the
# device is chosen (:func:`orb.device.configure_mindspore`) and read when a model is built and its graphs compiled
SUM_FORMS = ("float64", "split")
_sum_form = {"name": "float64"}


def sum_form_for_device(device_target: str) -> str:
    """``split`` on Ascend (no float64 arithmetic to rely on), ``float64`` elsewhere."""
    return "split" if device_target == "Ascend" else "float64"


def set_sum_form(name: str) -> None:
    """The form of float32 sums in graphs compiled from now on (:func:`sum_form_for_device`; tests force ``split``).
    Set it before a model is built and keep it while the model's graphs compile: a model records the form it was
    built in (``sum_form``, which a compile cache sees among its constants)."""
    if name not in SUM_FORMS:
        raise ValueError(f"sum form must be one of {SUM_FORMS}, got {name!r}")
    _sum_form["name"] = name


def sum_form() -> str:
    return _sum_form["name"]


_EVERY_SIZE = threading.local()  # per thread: MindSpore traces a graph in the thread that calls it


@contextmanager
def dynamic_shapes():
    """Graphs this thread traces meanwhile take inputs of any size (``Cell.set_inputs`` with unknown lengths): their
    segment sums and a conservative model's gradient take forms MindSpore accepts there (:mod:`orb.models.sums`;
    the gradient's form is for prediction only). Another thread's graphs, a training step compiled beside a
    calculator's call, are traced as before."""
    before, _EVERY_SIZE.on = traced_for_every_size(), True
    try:
        yield
    finally:
        _EVERY_SIZE.on = before


def traced_for_every_size() -> bool:
    """Whether the graph this thread is tracing takes inputs of any size (:func:`dynamic_shapes`)."""
    return getattr(_EVERY_SIZE, "on", False)


def is_mixed(name: Optional[str] = None) -> bool:
    return (name or precision()) in ("bf16-mixed", "fp16-mixed")


def is_float64(name: Optional[str] = None) -> bool:
    return (name or precision()) == "float64"


def numpy_dtype(name: Optional[str] = None):
    """The float type of parameters, inputs and constants: float64 in ``float64``, else float32."""
    return np.float64 if is_float64(name) else np.float32


def mindspore_dtype(name: Optional[str] = None):
    import mindspore as ms

    return ms.float64 if is_float64(name) else ms.float32


def matmul_precision(name: Optional[str] = None) -> str:
    """What the device's float32 matrix products may use: ``high`` (HF32/TF32) only in ``float32-high``."""
    return "high" if (name or precision()) == "float32-high" else "highest"


def rounding_cell(name: str, device_target: str):
    """The casts of mixed mode ``name`` around a matrix product, as a cell: ``half(x)`` gives an operand as the cube
    unit takes it, ``full(y)`` the result back in float32.

    Native (``fp16-mixed`` anywhere, ``bf16-mixed`` off the CPU): casts to the half type and back, with MindSpore's
    own gradients (a cast's gradient is the cast back: the incoming gradient is rounded as the device rounds it).
    Emulated (``bf16-mixed`` on the CPU): float32 tensors holding bfloat16 values, rounded by a cast there and back,
    whose gradient is rounded alike."""
    import mindspore as ms
    from mindspore import nn

    class RoundToBf16(nn.Cell):
        """x -> the nearest bfloat16 value, as float32 (round to nearest even, MindSpore's cast); the gradient is
        rounded the same way (what flows back through a bfloat16 tensor)."""

        def construct(self, x):
            return x.astype(ms.bfloat16).astype(ms.float32)

        def bprop(self, x, out, dout):
            return (dout.astype(ms.bfloat16).astype(ms.float32),)

    class HalfRounding(nn.Cell):
        def __init__(self):
            super().__init__()
            self.emulated = name == "bf16-mixed" and device_target == "CPU"
            self.dtype = ms.bfloat16 if name == "bf16-mixed" else ms.float16
            self.round = RoundToBf16()

        def half(self, x):
            if self.emulated:
                return self.round(x)
            return x.astype(self.dtype)

        def full(self, y):
            if self.emulated:
                return self.round(y)
            return y.astype(ms.float32)

    return HalfRounding()


def half_rounding():
    """The mixed mode's casts for cells built now, or None (float32 and float64 compute as they are)."""
    import mindspore as ms

    name = precision()
    return rounding_cell(name, ms.get_context("device_target")) if is_mixed(name) else None
