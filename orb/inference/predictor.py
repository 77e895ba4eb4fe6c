"""Compiled inference: energies, forces and stresses in physical units for any batch size.

Where MindSpore can (:func:`one_graph_for_every_size`), the calculator, orb-relax and orb-evaluate compile one graph
for batches of every size: each batch is padded to its own shape (:meth:`Predictor.shape_of`) and run through it. A
shape met more than :data:`OWN_GRAPH_AFTER` times (an MD run, a long relaxation) gets a graph of its own, orb-md's,
which computes the same bits faster: of those, the :data:`OWN_GRAPHS_AT_MOST` used last keep theirs (a workflow over
many sizes moves on from one to the next). Elsewhere, and in orb-md, batches are padded to a bucket shape so that
graph mode compiles once per bucket; a batch that outgrows every bucket adds a larger one (by ``growth``), which is
logged.
"""

import collections
import contextlib
import logging
import math
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from orb.data.buckets import Bucket, round_up
from orb.data.batching import pad_batch
from orb.data.graphs import AtomGraphs
from orb.data.tensors import model_inputs
from orb.device import graph_mode
from orb.errors import OrbInputError
from orb.graph_cache import compile_cell
from orb.models.cells import PredictCell
from orb.precision import dynamic_shapes

log = logging.getLogger("orb")
EVERY_SIZE = "every size"  # the key of the one graph in Predictor.compiled and .sources
# Calls of one shape after which it gets a graph of its own: one compilation (1.6-2.6 s, full orb-v2 on the CPU)
# against the graph for every size's 10-130 ms more per call (docs/benchmarks.md, ASE calculator: a cost per operator
# more than per atom), so that the two are about even by then.
OWN_GRAPH_AFTER = 100
# Shapes that keep a graph of their own, at most: each holds 30-50 MB of the process (docs/benchmarks.md,
# compile-memory), and a workflow over many sizes (orb-relax over a database) would otherwise keep one per size. A
# shape promoted beyond them takes the place of the one used longest ago, whose count of calls starts again, so that
# shapes taking turns earn each compilation with OWN_GRAPH_AFTER calls again.
OWN_GRAPHS_AT_MOST = 8


def one_graph_for_every_size() -> bool:
    """Whether prediction graphs are compiled once for batches of every size here: measured on the CPU
    (docs/benchmarks.md), in both operator profiles, where sums are in float64 (:mod:`orb.models.sums`). Not where
    sums are split (Ascend: ``UnsortedSegmentMax`` and the row count as a number), nor on an accelerator it was not
    measured on."""
    import mindspore as ms

    from orb.precision import sum_form

    return ms.get_context("device_target") == "CPU" and sum_form() == "float64"


# A float64 call's memory: MindSpore 2.10's CPU graphs keep the output of every float64 Add, Sub and Mul of a call
# until it ends (float32's, and float64 in PyNative mode, are reused), so a call grew by about 24 MB per atom with
# full-size orb-v2 and 110 MB with a conservative orb-v3 model, against 0.6 and 7 in float32 (docs/precision.md):
# 16 phonon supercells of 108 atoms in one call filled 24 GB. Atoms per call past one structure, direct and
# conservative models (about 6 and 7 GB for full-size models).
FLOAT64_ATOMS_PER_CALL = {False: 256, True: 64}


def float64_atoms_per_call(cfg) -> int:
    return FLOAT64_ATOMS_PER_CALL[cfg.conservative]


def float64_parts(batch: AtomGraphs, cfg) -> List[AtomGraphs]:
    """``batch`` as consecutive batches of at most :func:`float64_atoms_per_call` atoms (a larger structure alone),
    each a function of the batch alone (orb-md's shapes); a batch with padding graphs as it is."""
    from orb.data.batching import batch_graphs, split_batch

    limit = float64_atoms_per_call(cfg)
    if batch.num_nodes <= limit or batch.num_graphs < 2 or not np.all(batch.graph_mask):
        return [batch]
    groups: List[List[AtomGraphs]] = [[]]
    atoms = 0
    for graph in split_batch(batch):
        if groups[-1] and atoms + graph.num_nodes > limit:
            groups.append([])
            atoms = 0
        groups[-1].append(graph)
        atoms += graph.num_nodes
    return [batch_graphs(group) for group in groups]


def any_size(inputs) -> tuple:
    """Placeholders of ``inputs``' types and ranks whose first length (atoms, edges or structures) is unknown."""
    from mindspore import Tensor

    return tuple(Tensor(shape=[None] + list(t.shape[1:]), dtype=t.dtype) for t in inputs)


class Predictor:
    """Pads batches to their own or to reusable bucket shapes and runs the compiled forward pass."""

    def __init__(self, model, buckets: Optional[List[Bucket]] = None, growth: float = 1.25, multiple: int = 8,
                 reuse: bool = True):
        """``reuse``: a batch may take any known bucket it fits (fewest compilations: a relaxation's or an evaluation's
        batches of changing sizes). Without it a batch's shape is a function of the batch alone
        (:meth:`shape_of`): the padding changes the float32 products' blocking, hence their last bits, so a
        resumed run, whose process has not seen the earlier batches, computes what an uninterrupted one did
        (orb-md; not the calculator, which meets structures of many sizes: a shape for each cost 2.2x the time).
        With ``reuse``, where :func:`one_graph_for_every_size`, one graph takes every batch at its own shape."""
        from orb.models import is_float64_model

        self.model = model
        self.float64 = is_float64_model(model)  # its graphs must be built in float64 (atoms_to_graph(float64=))
        self.cell = PredictCell(model)  # a graph per shape
        self.any_size_cell = None  # the graph for every size, built at its first use
        self.calls: Dict[Bucket, int] = {}  # calls of each shape, with every_size
        # with every_size, the shapes with a graph of their own, each in a cell of its own (freed with it), the one
        # used longest ago first
        self.own_graphs: "collections.OrderedDict[Bucket, PredictCell]" = collections.OrderedDict()
        self.buckets: List[Bucket] = sorted(buckets or [])
        self.growth, self.multiple, self.reuse = growth, multiple, reuse
        self.every_size = reuse and one_graph_for_every_size()
        self.compiled: Dict[object, float] = {}  # each graph held: its bucket's compilation, or EVERY_SIZE's
        self.sources: Dict[object, str] = {}  # where each bucket's graph came from (orb.graph_cache), or EVERY_SIZE's
        self.said_parts = False  # the log's line on float64 batches run in parts, once

    def bucket_for(self, batch: AtomGraphs) -> Bucket:
        """The smallest known bucket that fits, else a new one (without the graph for every size).

        A first bucket fits the batch closely (an MD run or a relaxation repeats one structure size:
        padding is work done at every step): it is :meth:`shape_of` the batch, the shape orb-md gives it, so that
        the calculator, orb-relax and orb-md load one another's graph of a structure from the compile cache. A
        batch whose atoms a bucket holds but whose edges outgrew it (molecules and "inf" models: the count moves
        from step to step) takes orb-md's next shape too, never more atoms. Batches with more atoms get new buckets
        with ``growth`` headroom, so that a growing workload compiles a few shapes; edges get it too, except in a
        structure in which every atom has ``max_neighbors`` neighbours (orb-v2, orb-v3 "20" models in dense
        solids), which cannot gain edges at the same atom count.
        """
        if self.reuse:
            for bucket in self.buckets:
                if bucket.fits(batch):
                    return bucket
        held = any(batch.num_nodes < b.num_nodes and batch.num_graphs < b.num_graphs for b in self.buckets)
        if not self.reuse or not self.buckets or held:  # orb-md's shape of it: one graph for every tool that meets
            bucket = self.shape_of(batch)  # the batch (a first batch, the same atoms with more edges: no atoms added)
            if bucket not in self.buckets:
                self.buckets = sorted(self.buckets + [bucket])
            return bucket
        growth = self.growth
        max_nb = self.model.cfg.max_neighbors
        nodes = round_up(int(math.ceil((batch.num_nodes + 1) * growth)), self.multiple)
        saturated = batch.num_edges >= batch.num_nodes * max_nb
        edge_growth = growth if saturated else max(growth, 1.1)
        edges = min(nodes * max_nb, round_up(int(math.ceil(batch.num_edges * edge_growth)), self.multiple))
        bucket = Bucket(nodes, max(edges, self.multiple), batch.num_graphs + 1)
        log.info("batch of %d atoms / %d edges outgrew the buckets: adding (nodes %d, edges %d, graphs %d)",
                 batch.num_nodes, batch.num_edges, bucket.num_nodes, bucket.num_edges, bucket.num_graphs)
        self.buckets = sorted(self.buckets + [bucket])
        return bucket

    def shape_of(self, batch: AtomGraphs) -> Bucket:
        """The bucket of ``batch`` alone: atoms and edges rounded up to a geometric grid of ratio 1.1 (at most 10 %
        padding beyond ``multiple``; a count that moves a little from step to step keeps its shape, or takes the next
        one, each compiled once; a structure with every atom at ``max_neighbors`` exactly its edges), one padding
        graph."""
        nodes = self._on_grid(batch.num_nodes + 1)
        max_nb = self.model.cfg.max_neighbors
        if batch.num_edges >= batch.num_nodes * max_nb:  # every atom at max_neighbors: its edges cannot grow
            edges = round_up(batch.num_edges, self.multiple)
        else:
            edges = min(self._on_grid(batch.num_edges), nodes * max_nb)
        return Bucket(nodes, max(edges, self.multiple), batch.num_graphs + 1)

    def _on_grid(self, count: int) -> int:
        size = self.multiple
        while size < count:
            size = round_up(int(math.ceil(size * 1.1)), self.multiple)
        return size

    def __call__(self, batch: AtomGraphs) -> Dict[str, np.ndarray]:
        """``energy`` (B,), ``forces`` (N, 3), ``stress`` (B, 6) of the real graphs of ``batch`` (no ``stress`` for a
        model without a stress head: its zeros are no prediction), and for orb-v3 ``confidence`` (N, 50): the
        predicted distribution of each atom's force error over 0-0.3 eV/Å. :func:`per_structure` splits it.
        A float64 model's batch of many atoms runs in parts on the CPU (:func:`float64_parts`)."""
        check_batch_for_model(self.model.cfg, batch)
        parts = float64_parts(batch, self.model.cfg) if self._float64_in_parts() else [batch]
        if len(parts) == 1:
            return self._call_one(batch)
        if not self.said_parts:
            self.said_parts = True
            log.info("precision float64: batches of more than %d atoms run in parts (a float64 call's memory grows "
                     "15-40x faster with its atoms than float32's: docs/precision.md)",
                     float64_atoms_per_call(self.model.cfg))
        outputs = [self._call_one(part) for part in parts]
        return {key: np.concatenate([out[key] for out in outputs]) for key in outputs[0]}

    def _float64_in_parts(self) -> bool:
        """A float64 model on the CPU (where its memory was measured) whose parts each get a graph of their own size:
        the graph for every size, or orb-md's shape of each (a part padded to a bucket planned for whole batches
        would cost a whole batch's memory again, at each part)."""
        import mindspore as ms

        return self.float64 and ms.get_context("device_target") == "CPU" and (self.every_size or not self.reuse)

    def _call_one(self, batch: AtomGraphs) -> Dict[str, np.ndarray]:
        """:meth:`__call__` of one model call."""
        with graph_mode():  # (a caller in PyNative mode too: the compiled graph, from the compile cache; and one
            # thread at a time: another's calls cannot compile the same graph again; dynamic_shapes is per thread)
            try:
                return self._predict(batch)
            except OrbInputError:
                raise
            except Exception as exc:  # noqa: BLE001 (MindSpore's errors have no common type)
                if not self.every_size or EVERY_SIZE in self.compiled:
                    raise
                # a model or setting on which MindSpore refuses the graph for every size (a case not measured):
                # a graph per shape, as on other devices, said once, instead of failing every call
                reason = (str(exc).strip().splitlines() or [""])[0][:200]
                log.warning("the prediction graph for structures of every size failed (%s: %s): compiling a graph "
                            "per shape instead", type(exc).__name__, reason)
                self.every_size, self.any_size_cell = False, None
                self.sources.pop(EVERY_SIZE, None)
                return self._predict(batch)

    def _predict(self, batch: AtomGraphs) -> Dict[str, np.ndarray]:
        """:meth:`__call__` in graph mode, its batch checked."""
        real = batch.graph_mask
        n_real_nodes = int(batch.n_node[real].sum())
        bucket, graph, cell = self._graph_for(batch)
        padded = pad_batch(batch, bucket.num_nodes, bucket.num_edges, bucket.num_graphs)
        start = time.perf_counter()
        inputs = model_inputs(padded)
        first = cell is None or graph not in self.compiled
        with dynamic_shapes() if graph == EVERY_SIZE else contextlib.nullcontext():  # (also when MindSpore
            # traces the graph again by itself: a process-wide setting changed since)
            if first:
                cell, self.sources[graph] = self._compile(inputs, graph, cell)
            outputs = cell(*inputs)
        per_graph = lambda t: t.asnumpy()[: len(real)][real].astype(np.float64)  # noqa: E731
        per_node = lambda t: t.asnumpy()[:n_real_nodes].astype(np.float64)  # noqa: E731
        out = {"energy": per_graph(outputs[0]), "forces": per_node(outputs[1])}
        if self.model.cfg.has_stress:
            out["stress"] = per_graph(outputs[2])
        if len(outputs) > 3:
            out["confidence"] = per_node(outputs[3])
        if first:
            self.compiled[graph] = time.perf_counter() - start
            log.debug("compiled inference for %s in %.1f s (%s)", graph, self.compiled[graph],
                      self.sources.get(graph, "uncached"))
        return out

    def _graph_for(self, batch: AtomGraphs):
        """(the shape ``batch`` is padded to, the graph that runs it: that shape's, or :data:`EVERY_SIZE`, the cell
        that holds it, or None: a shape's own, to be built)."""
        if not (self.every_size and one_graph_for_every_size()):  # (the sums' form is read at each trace)
            while self.own_graphs:  # (their shapes' graphs are not self.cell's)
                self._let_go(next(iter(self.own_graphs)))
            bucket = self.bucket_for(batch)
            return bucket, bucket, self.cell
        bucket = self.shape_of(batch)
        self.calls[bucket] = self.calls.get(bucket, 0) + 1
        if bucket in self.own_graphs:
            self.own_graphs.move_to_end(bucket)
            return bucket, bucket, self.own_graphs[bucket]
        if self.calls[bucket] <= OWN_GRAPH_AFTER or OWN_GRAPHS_AT_MOST < 1:
            return bucket, EVERY_SIZE, self.any_size_cell
        return bucket, bucket, None

    def _let_go(self, bucket: Bucket) -> None:
        """Free ``bucket``'s own graph (with its cell); its calls count again towards one."""
        del self.own_graphs[bucket]
        self.compiled.pop(bucket, None)
        self.sources.pop(bucket, None)
        self.calls[bucket] = 0

    def _compile(self, inputs, graph, cell):
        """(the cell holding graph ``graph`` for ``inputs``: a shape's, or :data:`EVERY_SIZE`: for inputs of any size,
        where it came from: :func:`compile_cell`). With the graph for every size, a shape's own graph is a new cell,
        kept in :attr:`own_graphs`; elsewhere ``cell``, which compiles a graph per shape."""
        if graph != EVERY_SIZE:
            if cell is not None:
                return cell, compile_cell(cell, *inputs, kind="predict", settings=("predict",))
            cell = PredictCell(self.model)
            source = compile_cell(cell, *inputs, kind="predict", settings=("predict",))
            while len(self.own_graphs) >= OWN_GRAPHS_AT_MOST:  # (once compiled: a failed compilation lets none go)
                log.debug("prediction graph of %s let go for %s's (at most %d shapes keep their own)",
                          next(iter(self.own_graphs)), graph, OWN_GRAPHS_AT_MOST)
                self._let_go(next(iter(self.own_graphs)))
            self.own_graphs[graph] = cell
            return cell, source
        placeholders = any_size(inputs)
        self.any_size_cell = PredictCell(self.model)
        self.any_size_cell.set_inputs(*placeholders)
        return self.any_size_cell, compile_cell(self.any_size_cell, *placeholders, kind="predict",
                                                settings=("predict",))


def per_structure(out: Dict[str, np.ndarray], sizes: Sequence[int], periodic: Optional[Sequence[bool]] = None
                  ) -> List[Dict]:
    """Each structure's part of a batch's predictions ``out`` (``sizes``: its structures' atom counts, in order):
    ``energy`` (a float), ``forces`` (n, 3), ``stress`` (6,) when the model predicts one and, where ``periodic``
    is given, the model sees the structure as periodic (:func:`orb.data.graphs.model_sees_periodic`: a molecule's
    stress, of a zero or meaningless volume, is none), ``confidence`` (n, bins) for orb-v3 -- one split for the
    calculator, orb-evaluate, orb-relax and orb-md, so that none of them reports what the model did not predict (a
    stress-less model's zeros were written as its stress and pressure; a molecule's stress reached the calculator)."""
    parts, offset = [], 0
    for k, n in enumerate(sizes):
        part = {"energy": float(out["energy"][k]), "forces": out["forces"][offset:offset + n]}
        if "stress" in out and (periodic is None or periodic[k]):
            part["stress"] = out["stress"][k]
        if "confidence" in out:
            part["confidence"] = out["confidence"][offset:offset + n]
        parts.append(part)
        offset += n
    return parts


def check_batch_for_model(cfg, batch: AtomGraphs) -> None:
    """One line for a batch this model cannot compute: an element beyond its embedding table (MindSpore's Gather
    kernel failed with a C++ stack), or, for an OMol model, a structure without its total charge and spin (a batch
    with one such structure was computed with charge 0 and spin 0 for all)."""
    from orb.errors import StructureError

    top = int(np.max(batch.numbers)) if len(batch.numbers) else 0
    if top > cfg.num_elements:
        raise StructureError(f"atomic number {top} is beyond the elements {cfg.name} was built for "
                             f"(1..{cfg.num_elements})")
    if cfg.omol and (batch.charge is None or batch.spin is None):
        raise StructureError(f"{cfg.name} needs every structure's total charge and spin (atoms.info['charge'] and "
                             "atoms.info['spin']); a structure of this batch has none")
