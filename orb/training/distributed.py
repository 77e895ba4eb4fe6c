"""Single-device and data-parallel execution contexts for the training loop.

``Distributed()`` is the single-device context. :func:`init_data_parallel` starts MindSpore's
communication (inside an ``msrun`` job), sets DATA_PARALLEL with gradient averaging and returns
a context whose collectives the trainer uses: a gradient reducer inside the compiled step, an
in-graph all-reduce for normaliser statistics, and host-side sums for metrics.
"""

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

log = logging.getLogger("orb")


class AllReduceSum:
    """Callable in-graph sum over all ranks (used for normaliser batch statistics)."""

    def __init__(self):
        from mindspore import ops

        self.op = ops.AllReduce(ops.ReduceOp.SUM)

    def __call__(self, x):
        return self.op(x)


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def grad_reducer(self, parameters):
        """Averages gradients over ranks (``nn.DistributedGradReducer``), or None on one device."""
        if not self.parallel:
            return None
        from mindspore import nn

        return nn.DistributedGradReducer(parameters, mean=True, degree=self.world_size)

    def graph_allreduce(self) -> Optional[AllReduceSum]:
        return AllReduceSum() if self.parallel else None

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum of a host array over all ranks (float64 in, float64 out)."""
        values = np.asarray(values, dtype=np.float64)
        if not self.parallel:
            return values
        from mindspore import Tensor, ops

        # float32 all-reduce of values split into a high and a low part keeps ~float64 precision
        high = values.astype(np.float32)
        low = (values - high.astype(np.float64)).astype(np.float32)
        op = ops.AllReduce(ops.ReduceOp.SUM)
        both = op(Tensor(np.stack([high, low]))).asnumpy().astype(np.float64)
        return both[0] + both[1]

    def spread(self, values: np.ndarray) -> np.ndarray:
        """Per element, the root-mean-square deviation across ranks (zeros on one device).

        Built from sums only (MindSpore's CPU AllReduce supports nothing else).
        """
        values = np.asarray(values, dtype=np.float64)
        if not self.parallel:
            return np.zeros_like(values)
        mean = self.sum(values) / self.world_size
        return np.sqrt(self.sum((values - mean) ** 2) / self.world_size)

    def check_same_parameters(self, model) -> None:
        """All ranks must start from identical weights: compare cheap checksums across ranks."""
        if not self.parallel:
            return
        sums = [(float(p.asnumpy().astype(np.float64).sum()), float(np.abs(p.asnumpy()).astype(np.float64).sum()))
                for _, p in model.parameters_and_names()]
        checksum = np.array(sums).sum(axis=0)
        spread = self.spread(checksum)
        if np.any(spread > 1e-6 * np.maximum(np.abs(checksum), 1.0)):
            raise RuntimeError(f"rank {self.rank}: model parameters differ between ranks (checksum spread {spread}); "
                               "all ranks must load the same checkpoint and use the same random_seed")
        log.info("parameters identical on all %d ranks (checksum %.6e)", self.world_size, checksum[1])


def init_data_parallel(optimizer_shard: bool = False) -> Distributed:
    """Initialise MindSpore communication for an ``msrun`` job: DATA_PARALLEL, gradients averaged.

    ``optimizer_shard`` turns on MindSpore's optimizer parallel (optimizer state sharded over the
    data-parallel ranks, Ascend/GPU only).
    """
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    init()
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world)
    if optimizer_shard:
        ms.set_auto_parallel_context(enable_parallel_optimizer=True)
    return Distributed(rank=rank, world_size=world)
