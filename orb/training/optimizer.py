"""PyTorch's Adam (or plain SGD) over all trained parameters as one flat vector, inside the compiled step.

Why flat: gradient clipping as one operation (per-tensor clipping made MindSpore's compiler
spend ~55 s and ~2 GB on orb-v2), one fused Adam kernel, and optimizer sharding (ZeRO-1) is a
slice of that vector on each rank.

A step is made of separate pieces, in this order (``orb.training.steps.TrainStep``):

1. the gradient is summed over data-parallel ranks by the run's gradient reducer: MindSpore's
   ``nn.DistributedGradReducer`` over the per-parameter gradients (``finetune_parallel.py``
   builds it) or, with a sharded optimizer, :class:`ShardedGradient` (a reduce-scatter: each
   rank receives the sum of its own slice only);
2. :meth:`FlatAdam.flat_gradient`: flattened (this rank's slice when sharded), with the facts
   every rank must agree on (is it finite, its global norm);
3. with ``anchor`` (L2-SP), the penalty's gradient ``2 w (p - p_0)`` added, each element's ``w`` from its
   parameter's group and ``p_0`` the weights the optimizer started from (a resume restarts from the same
   starting checkpoint, so ``p_0`` is the same);
   clipped (:func:`clip`): ``value`` clamps each element to [-c, c] (orb-models 0.4.2), ``norm``
   rescales to a global L2 norm of at most c (PyTorch's ``clip_grad_norm_``), ``none``;
4. the update rule (:meth:`FlatAdam.apply`): Adam exactly as ``torch.optim.Adam``: m <- b1 m +
   (1 - b1) g, v <- b2 v + (1 - b2) g^2, p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t)
   + eps), with the schedule's lr and b1 at step t (PyTorch raises the *current* b1 to the power
   t); MindSpore's fused ``Adam`` kernel with eps scaled by sqrt(1 - b2^t), the same formula.
   ``algorithm="sgd"``: p <- p - lr g (its update is proportional to the gradient, so comparisons
   of runs can see a wrong gradient scale that Adam would hide);
5. sharded: the updated slices are all-gathered, so every rank ends the step with identical
   parameters, which are written into the model;
   With ``lr_scale`` (per-group learning-rate multipliers) each element's update is scaled by its factor
   (the update of the rule above times the factor: Adam's own arithmetic, then ``p_old + f (p_new - p_old)``);
6. :class:`WeightAverage`: an exponential moving average of the weights (``ema_decay``).

The optimizer keeps its own flat float32 copy of the parameters (its slice, when sharded).
"""

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.auto_generate.gen_ops_prim import SplitWithSize

from orb.models.primitives import Broadcasts
from orb.training.config import ALGORITHMS
from orb.training.schedule import Schedule

CLIP_MODES = ("value", "norm", "none")


_flatten_one = ops.MultitypeFuncGraph("flatten_one")
_assign_piece = ops.MultitypeFuncGraph("assign_piece")


@_flatten_one.register("Tensor")
def _flatten_tensor(tensor):
    return tensor.reshape(-1)


def _flat(hyper_map, tensors):
    """Tensors joined into one flat vector."""
    return ops.concat(hyper_map(_flatten_one, tensors))


@_assign_piece.register("Tensor", "Tensor")
def _assign_tensor(param, piece):
    return ops.assign(param, piece.reshape(param.shape))


WRITE_GROUP = 32  # parameters per piece of the write-back (one split into every parameter compiled in O(n^2))
_recursion_limit = 1000  # MindSpore's default
BUCKET = 1 << 22  # floats per piece of the flat gradient a ``cpu``-profile reducer sums (16 MB, as PyTorch DDP's 25 MB)


def _raise_recursion_limit(limit: int) -> None:
    """MindSpore's compiler walks tuples element by element: flattening orb-v2's ~340 gradients into one vector
    needs a deeper call limit than the default 1000 (never lowered once raised)."""
    global _recursion_limit
    if limit > _recursion_limit:
        ms.set_recursion_limit(limit)
        _recursion_limit = limit


class Sharding:
    """This rank's part of the flat vector (elements [rank * size, (rank + 1) * size) of the padded vector) and
    the collectives ZeRO-1 needs: a reduce-scatter of the gradient, an all-gather of the updated parameters, a
    sum of a few scalars."""

    def __init__(self, rank: int, world_size: int, reduce_scatter: Callable, all_gather: Callable,
                 all_reduce: Callable):
        self.rank, self.world_size = rank, world_size
        self.reduce_scatter, self.all_gather, self.all_reduce = reduce_scatter, all_gather, all_reduce


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


MIN_TABLE = 1024  # steps: every shorter run's schedule has the same shape


def padded_table(values: np.ndarray, dtype) -> np.ndarray:
    """A per-step table in ``dtype``, padded with its last value to a power of two of at least :data:`MIN_TABLE`
    steps (the step index is clamped to the schedule's last step, so the padding is never read)."""
    capacity = max(MIN_TABLE, 1 << max(len(values) - 1, 0).bit_length())
    table = np.empty(capacity, dtype)
    table[:len(values)] = values
    table[len(values):] = values[-1]
    return table


def clip(flat, mode: str, value: float, norm, broadcasts: Broadcasts):
    """The gradient clipped: ``value`` clamps each element, ``norm`` rescales ``flat`` so that the global norm
    (``norm``, over all ranks' slices) is at most ``value``, ``none`` leaves it."""
    if mode == "value":
        return ops.clamp(flat, -value, value)
    if mode == "norm":
        scale = ops.clamp(value / (norm + 1e-6), None, 1.0).astype(flat.dtype)
        return broadcasts.scale(flat, scale)
    return flat


class WeightAverage(nn.Cell):
    """Exponential moving average of the weights, flat, with torch_ema's / MACE's warm-up:
    decay_t = min(decay, (1 + t) / (10 + t))."""

    def __init__(self, size: int, decay: float, dtype=np.float32):
        super().__init__(auto_prefix=False)
        self.decay = float(decay)
        self.value = Parameter(Tensor(np.zeros(size, dtype)), name="optimizer_ema", requires_grad=False)
        self.descend = ops.ApplyGradientDescent()

    def construct(self, weights, step):
        t = step.astype(weights.dtype)
        decay = ops.clamp((1.0 + t) / (10.0 + t), None, self.decay)
        # ema <- ema - (1 - decay) (ema - weights), in place: one fused kernel, no broadcast scalar
        return self.descend(self.value, 1.0 - decay, self.value - weights)


class ShardedGradient(nn.Cell):
    """The gradient reducer of a sharded optimizer (ZeRO-1): the flat gradient reduce-scattered, so each rank
    receives the sum over ranks of its own slice only (half an all-reduce's traffic)."""

    def __init__(self, sharding: Sharding, padding: int):
        super().__init__(auto_prefix=False)
        self.reduce_scatter, self.padding = sharding.reduce_scatter, padding
        self.hyper_map = ops.HyperMap()

    def construct(self, grads):
        flat = _flat(self.hyper_map, grads)
        if self.padding:
            flat = ops.concat((flat, ops.zeros(self.padding, flat.dtype)))
        return self.reduce_scatter(flat)


class AllReduceSlice(nn.Cell):
    """A reduce-scatter where the backend has none (MindSpore 2.10's CPU): the sum over ranks, then this rank's
    slice (the traffic of an all-reduce)."""

    def __init__(self, all_reduce: Callable, rank: int, world_size: int):
        super().__init__()
        self.all_reduce, self.rank, self.world_size = all_reduce, rank, world_size

    def construct(self, flat):
        size = flat.shape[0] // self.world_size
        return self.all_reduce(flat)[self.rank * size:(self.rank + 1) * size]


class FlatAdam(nn.Cell):
    """Adam (PyTorch's formula) or SGD with the schedule's per-step lr and beta1 on a flat copy of the parameters:
    the update rule, with clipping before it, the sharded write-back and the weight average after it."""

    def __init__(self, params: Sequence[Parameter], schedule: Schedule, beta2: float = 0.999, eps: float = 1e-8,
                 clip_mode: str = "value", clip_value: float = 0.5, sharding: Optional[Sharding] = None,
                 ema_decay: float = 0.0, algorithm: str = "adam", anchor: Optional[np.ndarray] = None,
                 lr_scale: Optional[np.ndarray] = None):
        super().__init__(auto_prefix=False)
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        self.params = list(params)
        # float64 models (precision float64) keep float64 state and update in float64 arithmetic
        self.real = np.float64 if self.params and self.params[0].dtype == ms.float64 else np.float32
        self.shapes = [tuple(p.shape) for p in self.params]
        self.sizes = [int(np.prod(s)) if s else 1 for s in self.shapes]
        self.size = int(sum(self.sizes))
        world = sharding.world_size if sharding is not None else 1
        self.local_size = -(-self.size // world)
        self.padding = self.local_size * world - self.size
        self.sharding = sharding
        self.offset = sharding.rank * self.local_size if sharding is not None else 0
        self.clip_mode, self.clip_value = clip_mode, float(clip_value)
        self.beta2 = float(beta2)
        # the schedule as parameters, not constants, at a capacity that runs of similar length share: a run that
        # changes only lr, lr_schedule, warmup_fraction or max_epochs computes with the graphs another one compiled
        num_steps = len(schedule.lr)
        for name, values in _step_tables(schedule, beta2, eps).items():
            setattr(self, f"table_{name}", Parameter(Tensor(padded_table(values, self.real)),
                                                     name=f"optimizer_schedule_{name}", requires_grad=False))
        self.last_step = Parameter(Tensor(np.array(num_steps - 1, np.int32)), name="optimizer_schedule_last_step",
                                   requires_grad=False)
        self.beta2_tensor = Tensor(self.real(beta2))
        self.step = Parameter(Tensor(np.array(0, np.int32)), name="optimizer_step", requires_grad=False)
        zeros = np.zeros(self.local_size, self.real)
        moments = zeros if algorithm == "adam" else np.zeros(1, self.real)  # plain SGD keeps no moments
        self.moment1 = Parameter(Tensor(moments), name="optimizer_moment1", requires_grad=False)
        self.moment2 = Parameter(Tensor(moments.copy()), name="optimizer_moment2", requires_grad=False)
        self.master = Parameter(Tensor(zeros), name="optimizer_master", requires_grad=False)
        self.ema_decay = float(ema_decay)
        self.average = WeightAverage(self.size, self.ema_decay, self.real) if self.ema_decay > 0 else None
        _raise_recursion_limit(4 * len(self.params) + 1000)
        self.adam = ops.Adam()
        self.descend = ops.ApplyGradientDescent()  # var -= alpha * delta in place (the SGD step)
        self.hyper_map = ops.HyperMap()
        self.split_with_size = SplitWithSize()  # one kernel (ops.split unrolls a Python loop per piece)
        self.param_tuple = ms.ParameterTuple(self.params)  # (registers the parameters in the cell: keep it)
        # the write-back in groups of WRITE_GROUP parameters: one split into orb-v2's 336 tensors compiled in 3.4 s
        # (growing with the square of the count, measured), 32 at a time in 0.7 s; the same values
        groups = [range(i, min(i + WRITE_GROUP, len(self.params))) for i in range(0, len(self.params), WRITE_GROUP)]
        self.write_groups = tuple(ms.ParameterTuple([self.params[j] for j in g]) for g in groups)
        self.write_sizes = tuple(tuple(self.sizes[j] for j in g) for g in groups)
        self.write_chunks = tuple(sum(sizes) for sizes in self.write_sizes)
        self.broadcasts = Broadcasts()
        self.buckets = tuple([BUCKET] * (self.size // BUCKET) + ([self.size % BUCKET] if self.size % BUCKET else []))
        self.sync_from_model()
        # per element, this rank's slice: 2 w of the anchor (None: off) and the starting weights; the lr factor
        self.anchored = anchor is not None and bool(np.any(anchor))
        if self.anchored:
            self.anchor_scale = Parameter(Tensor(2.0 * self._local(anchor)), name="optimizer_anchor_scale",
                                          requires_grad=False)
            self.anchor_ref = Parameter(Tensor(self._local(self.flat_parameters())), name="optimizer_anchor_ref",
                                        requires_grad=False)
        self.scaled = lr_scale is not None and not np.all(np.asarray(lr_scale) == 1.0)
        if self.scaled:
            self.lr_factor = Parameter(Tensor(self._local(lr_scale)), name="optimizer_lr_factor", requires_grad=False)

    def _local(self, values: np.ndarray) -> np.ndarray:
        """This rank's slice of a full-length per-element vector (the parameters' float type, padded)."""
        padded = np.concatenate([np.asarray(values, self.real).reshape(-1), np.zeros(self.padding, self.real)])
        return padded[self.offset:self.offset + self.local_size]

    @property
    def ema(self) -> Parameter:
        return self.average.value

    def gradients_to_reduce(self) -> List[Parameter]:
        """What the run's gradient reducer (``nn.DistributedGradReducer``) is built for: the trained parameters,
        or in the ``cpu`` operator profile the flat gradient in 16 MB buckets, one placeholder parameter per
        bucket. MindSpore's CPU collectives pipeline such buckets as fast as one call per tensor for full
        models and faster for small ones (85 tensors: docs/benchmarks.md); on Ascend and GPU MindSpore fuses
        the per-parameter calls itself."""
        if not self.broadcasts.cpu:
            return self.params
        return [Parameter(Tensor(np.zeros(1, self.real)), name=f"flat_gradient_bucket_{i}", requires_grad=False)
                for i in range(len(self.buckets))]

    def prepare_for_reduction(self, grads):
        """The gradients as the reducer expects them (see :meth:`gradients_to_reduce`)."""
        if not self.broadcasts.cpu:
            return grads
        return self.split_with_size(_flat(self.hyper_map, grads), self.buckets, 0)

    def gradient_reducer(self) -> Optional[nn.Cell]:
        """The reducer a sharded optimizer needs (:class:`ShardedGradient`), else None (the run's own)."""
        return ShardedGradient(self.sharding, self.padding) if self.sharding is not None else None

    # ------------------------------------------------------------------ host side
    def flat_parameters(self) -> np.ndarray:
        return np.concatenate([p.asnumpy().reshape(-1).astype(self.real) for p in self.params])

    def sync_from_model(self) -> None:
        """Take the model's current parameters as the optimizer's copy (after loading weights)."""
        flat = self.flat_parameters()
        padded = np.concatenate([flat, np.zeros(self.padding, self.real)])
        self.master.set_data(Tensor(padded[self.offset:self.offset + self.local_size]))
        if self.average is not None:
            self.average.value.set_data(Tensor(flat))

    def split(self, flat: np.ndarray) -> List[np.ndarray]:
        """A flat host vector (full length) as per-parameter arrays."""
        out, start = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(flat[start:start + size].reshape(shape))
            start += size
        return out

    # ------------------------------------------------------------------ compiled step
    def flat_gradient(self, reduced):
        """(this rank's flat gradient, is the whole gradient finite, its global L2 norm) from the reduced
        gradient: per-parameter tensors, or this rank's slice from :class:`ShardedGradient`. Every rank
        reaches the same verdict (the sharded one through one sum of two numbers)."""
        if self.sharding is None:
            flat = _flat(self.hyper_map, reduced)
            finite = ops.isfinite(flat).all()
            norm = self._norm(flat) if self.clip_mode == "norm" else ops.zeros((), flat.dtype)
            return flat, finite, norm
        local = reduced
        nonfinite = (~ops.isfinite(local)).astype(local.dtype).sum()
        square = self._norm(local) ** 2 if self.clip_mode == "norm" else ops.zeros((), local.dtype)
        both = self.sharding.all_reduce(ops.stack((nonfinite, square)))
        return local, both[0] < 0.5, ops.sqrt(both[1])

    def construct(self, grads):
        """One step from unreduced per-parameter gradients (one device)."""
        flat, _, norm = self.flat_gradient(grads)
        return self.apply(flat, norm)

    def _norm(self, flat):
        return ops.sqrt(self.broadcasts.row_sum(flat.reshape(1, -1) * flat.reshape(1, -1))).reshape(())

    def _global_norm(self, local):
        """The L2 norm of the whole gradient from this rank's slice (a sum over ranks when sharded)."""
        if self.sharding is None:
            return self._norm(local)
        return ops.sqrt(self.sharding.all_reduce(self._norm(local).reshape(1) ** 2)).reshape(())

    def _adam64(self, grad, step):
        """The fused kernel's update (torch.optim.Adam's formula, eps already scaled) in float64 arithmetic: MindSpore
        2.10's ``Adam`` kernel takes float16 and float32 only."""
        beta1, lr = ops.gather(self.table_beta1, step, 0), ops.gather(self.table_lr, step, 0)
        beta1_power, beta2_power = ops.gather(self.table_beta1_power, step, 0), ops.gather(self.table_beta2_power, step, 0)
        m = self.moment1 * beta1 + grad * (1.0 - beta1)
        v = self.moment2 * self.beta2_tensor + grad * grad * (1.0 - self.beta2_tensor)
        rate = lr * ops.sqrt(1.0 - beta2_power) / (1.0 - beta1_power)
        update = m * rate / (ops.sqrt(v) + ops.gather(self.table_epsilon, step, 0))
        done = ops.assign(self.moment1, m)
        done = ops.depend(ops.assign(self.moment2, v), done)
        return ops.depend(ops.assign(self.master, self.master - update), done)

    def apply(self, grad, norm):
        """One update from this rank's flat gradient: anchor, clip, Adam (or SGD), write back, weight average."""
        if self.anchored:
            grad = grad + self.anchor_scale * (self.master - self.anchor_ref)
            if self.clip_mode == "norm":  # the penalty is part of the gradient whose norm is clipped
                norm = self._global_norm(grad)
        grad = clip(grad, self.clip_mode, self.clip_value, norm, self.broadcasts)
        step = ops.minimum(self.step, self.last_step)
        if self.scaled:  # the weights before the update, read before the update writes them
            before = self.master + 0.0
            grad = ops.depend(grad, before)
        else:
            before = self.master
        if self.algorithm == "sgd":
            done = self.descend(self.master, ops.gather(self.table_lr, step, 0), grad)
        elif self.real == np.float64:
            done = self._adam64(grad, step)
        else:
            done = self.adam(self.master, self.moment1, self.moment2,
                             ops.gather(self.table_beta1_power, step, 0), ops.gather(self.table_beta2_power, step, 0),
                             ops.gather(self.table_lr, step, 0), ops.gather(self.table_beta1, step, 0),
                             self.beta2_tensor, ops.gather(self.table_epsilon, step, 0), grad)
        updated = ops.depend(self.master, done)
        if self.scaled:
            updated = ops.depend(self.master, ops.assign(self.master, before + self.lr_factor * (updated - before)))
        full = updated if self.sharding is None else self.sharding.all_gather(updated)
        if self.padding:
            full = full[:self.size]
        # (a one-piece split before the groups' own splits lost their writes in MindSpore 2.10's graph mode, and a
        # HyperMap over the groups maps into them in PyNative mode: one group is the vector itself, then a loop)
        chunks = self.split_with_size(full, self.write_chunks, 0) if len(self.write_chunks) > 1 else (full,)
        done = full
        for k in range(len(self.write_groups)):
            pieces = self.split_with_size(chunks[k], self.write_sizes[k], 0)
            done = ops.depend(done, self.hyper_map(_assign_piece, self.write_groups[k], pieces))
        if self.average is not None:
            done = ops.depend(done, self.average(full, self.step))
        return ops.depend(ops.assign_add(self.step, ops.ones((), self.step.dtype)), done)
