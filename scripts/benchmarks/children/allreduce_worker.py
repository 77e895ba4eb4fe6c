"""One msrun worker of ``benchmark.py allreduce`` (``msrun ... allreduce_worker.py NAME REPEATS``): sums model
NAME's gradient-shaped tensors over the ranks in four ways, REPEATS times each after one call to compile; rank 0
prints ``RESULT {json}`` (tensors, floats, median seconds of each way) to its log."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import numpy as np  # noqa: E402


def allreduce_worker(name: str, repeats: int) -> None:
    """One msrun worker: sums model ``name``'s gradient-shaped tensors over the ranks with MindSpore's
    ``nn.DistributedGradReducer`` (what the trainer does), one AllReduce per tensor, one flat buffer and
    a flat buffer in 16 MB buckets, alternated; rank 0 prints the medians."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import get_rank, init
    from mindspore.ops.auto_generate.gen_ops_prim import SplitWithSize

    from orb.models import create

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    params = create(name).trainable_params()
    shapes = [tuple(p.shape) for p in params]
    ms.set_recursion_limit(4 * len(shapes) + 1000)  # the compiler walks the tuple of tensors element by element

    def values(rank):
        rng = np.random.default_rng(rank)
        return [rng.random(s).astype(np.float32) for s in shapes]

    grads = tuple(Tensor(v) for v in values(get_rank()))

    class PerTensor(nn.Cell):
        def __init__(self):
            super().__init__()
            self.reduce = ops.AllReduce(ops.ReduceOp.SUM)
            self.hyper_map = ops.HyperMap()

        def construct(self, grads):
            return self.hyper_map(self.reduce, grads)

    class Flat(nn.Cell):
        def __init__(self):
            super().__init__()
            self.reduce = ops.AllReduce(ops.ReduceOp.SUM)
            self.sizes = tuple(int(np.prod(s)) for s in shapes)
            self.split = SplitWithSize()

        def construct(self, grads):
            flat = self.reduce(ops.concat([g.reshape(-1) for g in grads]))
            return self.split(flat, self.sizes, 0)

    class Buckets(nn.Cell):  # the flat buffer summed in pieces of 2^22 floats (16 MB)
        def __init__(self):
            super().__init__()
            self.reduce = ops.AllReduce(ops.ReduceOp.SUM)
            self.hyper_map = ops.HyperMap()
            self.sizes = tuple(int(np.prod(s)) for s in shapes)
            total, piece = sum(self.sizes), 1 << 22
            self.pieces = tuple([piece] * (total // piece) + ([total % piece] if total % piece else []))
            self.split = SplitWithSize()

        def construct(self, grads):
            flat = ops.concat([g.reshape(-1) for g in grads])
            flat = ops.concat(self.hyper_map(self.reduce, self.split(flat, self.pieces, 0)))
            return self.split(flat, self.sizes, 0)

    class Reducer(nn.Cell):  # what finetune_parallel.py hands the compiled step
        def __init__(self):
            super().__init__()
            self.reducer = nn.DistributedGradReducer(params, mean=False, degree=2)

        def construct(self, grads):
            return self.reducer(grads)

    expected = [a + b for a, b in zip(values(0)[:3], values(1)[:3])]
    times = {}
    cells = {"reducer": Reducer(), "per tensor": PerTensor(), "flat": Flat(), "buckets": Buckets()}
    for kind, cell in cells.items():
        for i in range(repeats + 1):  # the first call compiles
            start = time.perf_counter()
            out = cell(grads)
            ms.runtime.synchronize()
            times.setdefault(kind, []).append(time.perf_counter() - start)
        for got, want in zip(out[:3], expected):  # a sum over both ranks, not a no-op
            np.testing.assert_allclose(got.asnumpy().reshape(want.shape), want, rtol=1e-6)
        times[kind] = times[kind][1:]
    if get_rank() == 0:
        floats = sum(int(np.prod(s)) for s in shapes)
        print("RESULT " + json.dumps({"tensors": len(shapes), "floats": floats,
                                      **{k: float(np.median(v)) for k, v in times.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("name", help="orb_v2 or an orb-v3 name (orb.models.MODEL_NAMES)")
    parser.add_argument("repeats", type=int, help="all-reduces of each kind (after one to compile)")
    args = parser.parse_args()
    allreduce_worker(args.name, args.repeats)


if __name__ == "__main__":
    main()
