"""AtomGraphs (numpy) -> the arrays the model and the loss take, in a fixed order, and MindSpore tensors."""

from typing import Optional, Tuple

import numpy as np

from orb.data.graphs import AtomGraphs

MODEL_INPUTS = ("numbers", "positions", "vectors", "senders", "receivers", "node_graph", "n_node", "nonperiodic", "cell",
                "unit_shifts", "charge", "spin", "head")
TARGET_INPUTS = ("graph_mask", "graph_weight", "energy", "forces", "stress")


def model_arrays(batch: AtomGraphs) -> Tuple[np.ndarray, ...]:
    """Numpy arrays in :data:`MODEL_INPUTS` order (int32 indices; values in the graph's float type, float32 or
    float64; charge and spin 0 if absent; ``head``: which heads predict each structure, 0 = the model's own)."""
    real = batch.positions.dtype if batch.positions.dtype == np.float64 else np.float32
    zeros_g = np.zeros(batch.num_graphs, real)
    return (
        batch.numbers.astype(np.int32),
        batch.positions.astype(real),
        batch.vectors.astype(real),
        batch.senders.astype(np.int32),
        batch.receivers.astype(np.int32),
        batch.node_graph.astype(np.int32),
        batch.n_node.astype(real),
        (~batch.periodic).astype(real),
        batch.cell.astype(real),
        batch.unit_shifts.astype(real),
        zeros_g if batch.charge is None else batch.charge.astype(real),
        zeros_g if batch.spin is None else batch.spin.astype(real),
        np.zeros(batch.num_graphs, np.int32) if batch.head is None else batch.head.astype(np.int32),
    )


def target_arrays(batch: AtomGraphs, graph_weight: Optional[np.ndarray] = None) -> Tuple[np.ndarray, ...]:
    """Numpy arrays in :data:`TARGET_INPUTS` order (in the graph's float type); absent labels become zeros.

    ``graph_weight`` is each graph's weight in the loss; by default 1 / (number of real graphs)
    for real graphs and 0 for padding graphs (the mean over the batch's structures).
    """
    real = batch.positions.dtype if batch.positions.dtype == np.float64 else np.float32
    mask = batch.graph_mask.astype(real)
    if graph_weight is None:
        graph_weight = mask / max(mask.sum(), 1.0)
    zeros_g, zeros_n = np.zeros(batch.num_graphs, real), np.zeros((batch.num_nodes, 3), real)
    return (
        mask,
        np.asarray(graph_weight, real),
        zeros_g if batch.energy is None else batch.energy.astype(real),
        zeros_n if batch.forces is None else batch.forces.astype(real),
        np.zeros((batch.num_graphs, 6), real) if batch.stress is None else batch.stress.astype(real),
    )


def loss_arrays(batch: AtomGraphs, graph_weight: Optional[np.ndarray] = None) -> Tuple[np.ndarray, ...]:
    return model_arrays(batch) + target_arrays(batch, graph_weight)


def to_tensors(arrays: Tuple[np.ndarray, ...]):
    from mindspore import Tensor

    return tuple(Tensor(a) for a in arrays)


def model_inputs(batch: AtomGraphs):
    return to_tensors(model_arrays(batch))


def loss_inputs(batch: AtomGraphs, graph_weight: Optional[np.ndarray] = None):
    return to_tensors(loss_arrays(batch, graph_weight))
