"""``gemm``: MindSpore's CPU MatMul against numpy's BLAS on a training step's products; ``breakdown``: where a
step's time goes, matrix-product kernel time by kind (oneDNN's verbose log) and everything else."""

import os
import sys
import tempfile

import numpy as np

from .common import calibration, gemm_rate, median_time
from .model import Setup

# The interaction layers' edge products (rows = edges of a batch of 8 demo structures): the first
# layer's edge columns, the hidden layer and the output layer of the edge MLP.
GEMM_SHAPES = {"orb_v2": (1772, [(256, 512), (512, 512), (512, 256)]),
               "orb-v3, 20 neighbours": (1856, [(256, 1024), (1024, 1024), (1024, 256)])}


def bench_gemm(args) -> None:
    """MindSpore's CPU MatMul against numpy's BLAS on the products a training step makes of each layer
    y = x W^T: the forward, the input gradient dY W and the weight gradient dY^T x, alternated."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from orb.device import configure_mindspore

    configure_mindspore("CPU", num_threads=int(os.environ.get("OMP_NUM_THREADS", "2")))
    rng = np.random.default_rng(0)

    class Products(nn.Cell):
        """Four independent products per call, so the call's fixed cost is shared."""

        def __init__(self, transpose_a: bool, transpose_b: bool):
            super().__init__()
            self.matmul = ops.MatMul(transpose_a=transpose_a, transpose_b=transpose_b)

        def construct(self, a, b):
            return [self.matmul(a[i], b[i]) for i in range(len(a))]

    print("| model | rows | in -> out | product | MindSpore MatMul (GFLOP/s) | numpy BLAS (GFLOP/s) | MindSpore / BLAS |")
    print("|---|---|---|---|---|---|---|")
    for model, (rows, layers) in GEMM_SHAPES.items():
        for d_in, d_out in layers:
            x, w, dy = ([rng.standard_normal(shape, np.float32) for _ in range(4)]
                        for shape in ((rows, d_in), (d_out, d_in), (rows, d_out)))
            cases = {"forward x W^T": (Products(False, True), x, w, lambda i: x[i] @ w[i].T),
                     "input grad dY W": (Products(False, False), dy, w, lambda i: dy[i] @ w[i]),
                     "weight grad dY^T x": (Products(True, False), dy, x, lambda i: dy[i].T @ x[i])}
            for name, (cell, a, b, reference) in cases.items():
                a_ms, b_ms = tuple(Tensor(v) for v in a), tuple(Tensor(v) for v in b)
                cell(a_ms, b_ms)  # compile
                ours, blas = [], []
                for _ in range(args.repeats):  # alternated, so a change of the host's speed hits both
                    ours.append(median_time(lambda: cell(a_ms, b_ms)[-1].asnumpy(), 1))
                    blas.append(median_time(lambda: [reference(i) for i in range(4)], 1))
                gflop = 4 * 2 * rows * d_in * d_out / 1e9
                r_ours, r_blas = gflop / np.median(ours), gflop / np.median(blas)
                print(f"| {model} | {rows} | {d_in} -> {d_out} | {name} | {r_ours:.0f} | {r_blas:.0f} | "
                      f"{r_ours / r_blas:.2f} |")
    print(f"\nhost matrix-multiply calibration (numpy, 1024^3): {gemm_rate():.0f} GFLOP/s; MindSpore {ms.__version__}")


PRODUCT_KINDS = ("forward and input-gradient products", "weight gradients (transposed first operand, dY^T x)",
                 "ones-vector products (row/column expansions and sums)")


class OneDnnLog:
    """The matrix products MindSpore's CPU backend runs through oneDNN, each with its kernel time, as
    oneDNN's verbose mode reports them (``dnnl_set_verbose`` of the library MindSpore loaded; the
    report goes to file descriptor 1, captured here while the log is on)."""

    def __init__(self):
        import ctypes

        import mindspore as ms

        self.libc = ctypes.CDLL(None)
        self.dnnl = ctypes.CDLL(os.path.join(os.path.dirname(ms.__file__), "lib", "libdnnl.so.3"))

    def run(self, fn) -> list:
        """Call ``fn`` with the log on; returns (kind, GFLOP, milliseconds) per matrix product it ran."""
        sys.stdout.flush()
        self.libc.fflush(None)
        saved = os.dup(1)
        with tempfile.TemporaryFile("w+") as capture:
            os.dup2(capture.fileno(), 1)
            self.dnnl.dnnl_set_verbose(1)
            try:
                fn()
            finally:
                self.libc.fflush(None)
                self.dnnl.dnnl_set_verbose(0)
                os.dup2(saved, 1)
                os.close(saved)
            capture.seek(0)
            return [p for p in map(self.parse, capture) if p]

    @staticmethod
    def parse(line: str):
        """``onednn_verbose,v1,primitive,exec,cpu,matmul,impl,prop,src:f32::blocked:ba::f0 wei:... dst:...,
        attrs,aux,MxK:KxN,ms`` -> (kind, GFLOP, ms); None for other lines."""
        fields = line.strip().split(",")
        if len(fields) < 8 or fields[0] != "onednn_verbose" or "exec" not in fields or "matmul" not in fields:
            return None
        src = next(f for f in fields if f.startswith("src:")).split()[0]
        layout = src.split("::")[1].split(":")[1]
        a, b = (list(map(int, side.split("x"))) for side in fields[-2].split(":"))
        m, k, n = int(np.prod(a[:-1])), a[-1], b[-1]
        if min(m, k, n) == 1:
            kind = PRODUCT_KINDS[2]
        elif layout != "".join(sorted(layout)):
            kind = PRODUCT_KINDS[1]
        else:
            kind = PRODUCT_KINDS[0]
        return kind, 2.0 * m * k * n / 1e9, float(fields[-1])


def bench_breakdown(args) -> None:
    """Where a step's time goes: matrix-product kernel time by kind (from oneDNN's own timing, in
    steps alternated with uninstrumented ones) and everything else (the step's median time minus it)."""
    from orb.device import configure_mindspore

    configure_mindspore("CPU", num_threads=int(os.environ.get("OMP_NUM_THREADS", "2")))
    rate_before = gemm_rate()
    setup = Setup(args.model, args.steps)
    log = OneDnnLog()
    print(f"{args.model}, batches of 8 demo structures ({setup.atoms:.0f} atoms, {setup.edges:.0f} edges on average), "
          f"padded to {setup.bucket}; medians over {args.steps} steps of each kind, instrumented (oneDNN's "
          "verbose log) and plain steps alternated\n")
    print("| step | part | time per step (ms) | share of the step | GFLOP per step | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    work_by_step = {}
    for kind in setup.steps:
        setup.run(kind, 0)  # compile
        plain, products = [], []
        for i in range(args.steps):
            products.append(log.run(lambda: setup.run(kind, i)))
            plain.append(setup.run(kind, i))
        step_ms = 1e3 * float(np.median(plain))
        per_kind = {k: [sum(ms for kk, _, ms in p if kk == k) for p in products] for k in PRODUCT_KINDS}
        work = {k: sum(g for kk, g, _ in products[0] if kk == k) for k in PRODUCT_KINDS}
        total_ms = float(np.median([sum(ms for _, _, ms in p) for p in products]))
        for k in (k for k in PRODUCT_KINDS if work[k]):
            t = float(np.median(per_kind[k]))
            print(f"| {kind} | {k} | {t:.0f} | {t / step_ms:.0%} | {work[k]:.1f} | {work[k] / t * 1e3:.0f} |")
        print(f"| {kind} | all matrix products | {total_ms:.0f} | {total_ms / step_ms:.0%} | "
              f"{sum(work.values()):.1f} | {sum(work.values()) / total_ms * 1e3:.0f} |")
        print(f"| {kind} | everything else | {step_ms - total_ms:.0f} | {1 - total_ms / step_ms:.0%} | | |")
        print(f"| {kind} | whole step (uninstrumented) | {step_ms:.0f} | 100% | | |")
        work_by_step[kind] = work
    rate_after = gemm_rate()
    rate = (rate_before + rate_after) / 2
    print(f"\nGFLOP per step: as run, on the padded bucket; the model benchmark's bound counts the real "
          f"(unpadded) work, {setup.forward_gflop():.1f} GFLOP per forward pass. Host matrix-multiply "
          f"calibration (numpy, 1024^3): {calibration(rate_before, rate_after)}; matrix products at that rate "
          "would take: " + ", ".join(f"{kind} {sum(w.values()) / rate * 1e3:.0f} ms"
                                     for kind, w in work_by_step.items()))
