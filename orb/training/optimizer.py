"""PyTorch's Adam (or plain SGD) over all trained parameters as one flat vector, inside the compiled step.

Why flat: one fused gradient all-reduce per step instead of one per tensor; gradient clipping
as one operation (per-tensor clipping made MindSpore's compiler spend ~55 s and ~2 GB on
orb-v2); and optimizer sharding (ZeRO-1) is a slice of that vector on each rank.

Per step, on the flat gradient ``g`` (and, sharded, on this rank's slice of it):

1. ``g`` is summed over data-parallel ranks (``all_reduce``, if given);
2. clipped: ``value`` clamps each element to [-c, c] (orb-models 0.4.2), ``norm`` rescales to a
   global L2 norm of at most c (PyTorch's ``clip_grad_norm_``), ``none``;
3. Adam exactly as ``torch.optim.Adam``: m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2,
   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), with the schedule's lr and b1
   at step t (PyTorch raises the *current* b1 to the power t). MindSpore's fused ``Adam``
   kernel is used with eps scaled by sqrt(1 - b2^t), which is the same formula;
4. sharded: each rank updates only its slice of the parameters and moments, then the slices are
   all-gathered; every rank ends the step with identical full parameters;
5. optionally an exponential moving average of the weights (``ema_decay``), kept flat beside them.

``algorithm="sgd"`` replaces step 3 by p <- p - lr g (no moments): its update is proportional to
the gradient, so comparisons of runs can see a wrong gradient scale that Adam would hide.

The optimizer keeps its own flat float32 copy of the parameters (its slice, when sharded) and
writes the updated values into the model's parameters after every step.
"""

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.auto_generate.gen_ops_prim import SplitWithSize

from orb.models.blocks import row_sum
from orb.training.config import ALGORITHMS
from orb.training.schedule import Schedule

CLIP_MODES = ("value", "norm", "none")


_flatten_one = ops.MultitypeFuncGraph("flatten_one")
_assign_piece = ops.MultitypeFuncGraph("assign_piece")


@_flatten_one.register("Tensor")
def _flatten_tensor(tensor):
    return tensor.reshape(-1)


@_assign_piece.register("Tensor", "Tensor")
def _assign_tensor(param, piece):
    return ops.assign(param, piece.reshape(param.shape))


_recursion_limit = 1000  # MindSpore's default
# The gradient all-reduce sums the flat buffer in buckets of 2^22 floats (16 MB, as PyTorch DDP's
# 25 MB buckets): on 2 CPU workers 25 % faster than one 100 MB all-reduce and as fast as one call
# per tensor (scripts/benchmark.py allreduce); collective libraries pipeline buckets of this size.
BUCKET = 1 << 22


def _raise_recursion_limit(limit: int) -> None:
    """MindSpore's compiler walks tuples element by element: splitting the flat vector into orb-v2's ~340
    tensors needs a deeper call limit than the default 1000 (never lowered once raised)."""
    global _recursion_limit
    if limit > _recursion_limit:
        ms.set_recursion_limit(limit)
        _recursion_limit = limit


class Sharding:
    """This rank's part of the flat vector: elements [rank * size, (rank + 1) * size) of the padded vector."""

    def __init__(self, rank: int, world_size: int, all_gather: Callable):
        self.rank, self.world_size, self.all_gather = rank, world_size, all_gather


def _step_tables(schedule: Schedule, beta2: float, eps: float) -> Dict[str, np.ndarray]:
    """Per-step scalars of the fused Adam kernel that reproduce torch.optim.Adam (float64, then float32)."""
    t = np.arange(1, len(schedule.lr) + 1, dtype=np.float64)
    beta1 = np.asarray(schedule.beta1, np.float64)
    return {
        "lr": np.asarray(schedule.lr, np.float64),
        "beta1": beta1,
        "beta1_power": beta1 ** t,
        "beta2_power": beta2 ** t,
        "epsilon": eps * np.sqrt(1.0 - beta2 ** t),
    }


class FlatAdam(nn.Cell):
    """Adam (PyTorch's formula) with the schedule's per-step lr and beta1, fused all-reduce, clipping and sharding."""

    def __init__(self, params: Sequence[Parameter], schedule: Schedule, beta2: float = 0.999, eps: float = 1e-8,
                 clip_mode: str = "value", clip_value: float = 0.5, all_reduce: Optional[Callable] = None,
                 sharding: Optional[Sharding] = None, ema_decay: float = 0.0, algorithm: str = "adam",
                 bucket: int = BUCKET):
        super().__init__(auto_prefix=False)
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        self.params = list(params)
        self.shapes = [tuple(p.shape) for p in self.params]
        self.sizes = [int(np.prod(s)) if s else 1 for s in self.shapes]
        self.size = int(sum(self.sizes))
        world = sharding.world_size if sharding is not None else 1
        self.local_size = -(-self.size // world)
        self.padding = self.local_size * world - self.size
        self.sharding = sharding
        self.offset = sharding.rank * self.local_size if sharding is not None else 0
        self.all_reduce = all_reduce
        total = self.local_size * world
        self.buckets = tuple([bucket] * (total // bucket) + ([total % bucket] if total % bucket else []))
        self.clip_mode, self.clip_value = clip_mode, float(clip_value)
        self.beta2 = float(beta2)
        self.num_steps = len(schedule.lr)
        for name, values in _step_tables(schedule, beta2, eps).items():
            setattr(self, f"table_{name}", Tensor(values.astype(np.float32)))
        self.beta2_tensor = Tensor(np.float32(beta2))
        self.step = Parameter(Tensor(np.array(0, np.int32)), name="optimizer_step", requires_grad=False)
        zeros = np.zeros(self.local_size, np.float32)
        moments = zeros if algorithm == "adam" else np.zeros(1, np.float32)  # plain SGD keeps no moments
        self.moment1 = Parameter(Tensor(moments), name="optimizer_moment1", requires_grad=False)
        self.moment2 = Parameter(Tensor(moments.copy()), name="optimizer_moment2", requires_grad=False)
        self.master = Parameter(Tensor(zeros), name="optimizer_master", requires_grad=False)
        self.ema_decay = float(ema_decay)
        if self.ema_decay > 0:
            self.ema = Parameter(Tensor(np.zeros(self.size, np.float32)), name="optimizer_ema", requires_grad=False)
        _raise_recursion_limit(4 * len(self.params) + 1000)
        self.adam = ops.Adam()
        self.descend = ops.ApplyGradientDescent()  # var -= alpha * delta in place (SGD step, EMA update)
        self.hyper_map = ops.HyperMap()
        self.sizes_tuple = tuple(self.sizes)
        self.split_with_size = SplitWithSize()  # one kernel (ops.split unrolls a Python loop per piece)
        self.param_tuple = ms.ParameterTuple(self.params)
        self.sync_from_model()

    # ------------------------------------------------------------------ host side
    def flat_parameters(self) -> np.ndarray:
        return np.concatenate([p.asnumpy().reshape(-1).astype(np.float32) for p in self.params])

    def sync_from_model(self) -> None:
        """Take the model's current parameters as the optimizer's copy (after loading weights)."""
        flat = self.flat_parameters()
        padded = np.concatenate([flat, np.zeros(self.padding, np.float32)])
        self.master.set_data(Tensor(padded[self.offset:self.offset + self.local_size]))
        if self.ema_decay > 0:
            self.ema.set_data(Tensor(flat))

    def split(self, flat: np.ndarray) -> List[np.ndarray]:
        """A flat host vector (full length) as per-parameter arrays."""
        out, start = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(flat[start:start + size].reshape(shape))
            start += size
        return out

    # ------------------------------------------------------------------ compiled step
    def _flatten(self, grads):
        flat = ops.concat(self.hyper_map(_flatten_one, grads))
        if self.padding:
            flat = ops.concat((flat, ops.zeros(self.padding, flat.dtype)))
        return flat

    def _sum_over_ranks(self, flat):
        if len(self.buckets) == 1:
            return self.all_reduce(flat)
        return ops.concat(self.hyper_map(self.all_reduce, self.split_with_size(flat, self.buckets, 0)))

    def _clip(self, flat):
        if self.clip_mode == "value":
            return ops.clamp(flat, -self.clip_value, self.clip_value)
        if self.clip_mode == "norm":
            norm = ops.sqrt(row_sum(flat.reshape(1, -1) * flat.reshape(1, -1))).reshape(())
            scale = ops.clamp(self.clip_value / (norm + 1e-6), None, 1.0).astype(flat.dtype)
            return flat * ops.tile(scale.reshape(1), flat.shape)  # Tile, not broadcasting: see expand_column
        return flat

    def _local(self, flat):
        if self.sharding is None:
            return flat
        return flat[self.offset:self.offset + self.local_size]

    def _write_back(self, updated_local):
        full = updated_local if self.sharding is None else self.sharding.all_gather(updated_local)
        if self.padding:
            full = full[:self.size]
        done = self.hyper_map(_assign_piece, self.param_tuple, self.split_with_size(full, self.sizes_tuple, 0))
        if self.ema_decay > 0:
            t = self.step.astype(full.dtype)
            decay = ops.clamp((1.0 + t) / (10.0 + t), None, self.ema_decay)  # warm-up as torch_ema / MACE
            # ema <- ema - (1 - decay) (ema - full), in place: one fused kernel, no broadcast scalar
            done = ops.depend(done, self.descend(self.ema, 1.0 - decay, self.ema - full))
        return done

    def reduce(self, grads):
        """The flat gradient, summed over data-parallel ranks (the same on every rank)."""
        flat = self._flatten(grads)
        if self.all_reduce is not None:
            flat = self._sum_over_ranks(flat)
        return flat

    def construct(self, grads):
        return self.apply(self.reduce(grads))

    def apply(self, flat):
        """One update from the reduced flat gradient: clip, Adam (or SGD), write back, EMA."""
        grad = self._local(self._clip(flat))
        step = ops.minimum(self.step, self.num_steps - 1)
        if self.algorithm == "sgd":
            done = self.descend(self.master, ops.gather(self.table_lr, step, 0), grad)
        else:
            done = self.adam(self.master, self.moment1, self.moment2,
                             ops.gather(self.table_beta1_power, step, 0), ops.gather(self.table_beta2_power, step, 0),
                             ops.gather(self.table_lr, step, 0), ops.gather(self.table_beta1, step, 0),
                             self.beta2_tensor, ops.gather(self.table_epsilon, step, 0), grad)
        updated = ops.depend(self.master, done)
        done = self._write_back(updated)
        return ops.depend(ops.assign_add(self.step, ops.ones((), self.step.dtype)), done)
