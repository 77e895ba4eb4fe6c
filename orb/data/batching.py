"""Batches of atom graphs: graphs concatenated into one (:func:`batch_graphs`), padded to a static shape so that a
compiled graph is reused (:func:`pad_batch`: the real graphs first, then one padding graph), and split back."""

from typing import List, Optional, Sequence

import numpy as np

from orb.data.graphs import PADDING_EDGE_LENGTH, AtomGraphs


def _concat_optional(arrays: Sequence[Optional[np.ndarray]]) -> Optional[np.ndarray]:
    if any(a is None for a in arrays):
        return None
    return np.concatenate(arrays, axis=0)


def batch_graphs(graphs: List[AtomGraphs]) -> AtomGraphs:
    """Concatenate graphs into one batch, offsetting sender/receiver indices by the node counts before them."""
    if not graphs:
        raise ValueError("batch_graphs needs at least one graph")
    offsets = np.cumsum([0] + [g.num_nodes for g in graphs[:-1]])
    return AtomGraphs(
        positions=np.concatenate([g.positions for g in graphs]),
        numbers=np.concatenate([g.numbers for g in graphs]),
        cell=np.concatenate([g.cell for g in graphs]),
        senders=np.concatenate([g.senders + o for g, o in zip(graphs, offsets)]),
        receivers=np.concatenate([g.receivers + o for g, o in zip(graphs, offsets)]),
        vectors=np.concatenate([g.vectors for g in graphs]),
        n_node=np.concatenate([g.n_node for g in graphs]),
        n_edge=np.concatenate([g.n_edge for g in graphs]),
        energy=_concat_optional([g.energy for g in graphs]),
        forces=_concat_optional([g.forces for g in graphs]),
        stress=_concat_optional([g.stress for g in graphs]),
        system_id=_concat_optional([g.system_id for g in graphs]),
        graph_mask=np.concatenate([g.graph_mask for g in graphs]),
        unit_shifts=np.concatenate([g.unit_shifts for g in graphs]),
        charge=_concat_optional([g.charge for g in graphs]),
        spin=_concat_optional([g.spin for g in graphs]),
        weight=_concat_optional([g.weight for g in graphs]),
        head=_concat_optional([g.head for g in graphs]),
    )


def empty_batch(with_energy: bool = True, with_forces: bool = True, with_stress: bool = True,
                with_charge: bool = False) -> AtomGraphs:
    """A batch of zero graphs (what a data-parallel rank gets when a batch has fewer structures than ranks)."""
    f32 = np.float32
    return AtomGraphs(
        positions=np.zeros((0, 3), f32), numbers=np.zeros(0, np.int64), cell=np.zeros((0, 3, 3), f32),
        senders=np.zeros(0, np.int64), receivers=np.zeros(0, np.int64), vectors=np.zeros((0, 3), f32),
        n_node=np.zeros(0, np.int64), n_edge=np.zeros(0, np.int64),
        energy=np.zeros(0, f32) if with_energy else None,
        forces=np.zeros((0, 3), f32) if with_forces else None,
        stress=np.zeros((0, 6), f32) if with_stress else None,
        system_id=np.zeros(0, np.int64),
        charge=np.zeros(0, f32) if with_charge else None,
        spin=np.zeros(0, f32) if with_charge else None,
    )


def pad_batch(batch: AtomGraphs, num_nodes: int, num_edges: int, num_graphs: int) -> AtomGraphs:
    """Pad a batch to fixed sizes so a compiled graph-mode step sees one shape.

    Padding nodes (atomic number 0) all belong to the first padding graph, which has an identity
    cell (so no torque removal runs on it) and ``graph_mask`` False (zero weight in loss and
    metrics). Padding edges join the first padding node to itself with length
    ``PADDING_EDGE_LENGTH`` (beyond the attention cutoff), so no real node's neighbourhood changes;
    their unit shift is that vector too, so edge vectors rebuilt from positions, shifts and the
    identity cell have the same length. Further padding graphs are empty.
    """
    pad_n, pad_e, pad_g = num_nodes - batch.num_nodes, num_edges - batch.num_edges, num_graphs - batch.num_graphs
    if pad_n < 0 or pad_e < 0 or pad_g < 0:
        raise ValueError(
            f"batch of {batch.num_graphs} graphs, {batch.num_nodes} nodes, {batch.num_edges} edges does not fit "
            f"the padded size ({num_graphs} graphs, {num_nodes} nodes, {num_edges} edges)"
        )
    if (pad_n or pad_e) and pad_g == 0:
        raise ValueError("padding nodes/edges need a padding graph: num_graphs must exceed the batch's graph count")
    if pad_e and not pad_n:
        raise ValueError("padding edges need a padding node: num_nodes must exceed the batch's node count")
    if pad_g == 0:
        return batch
    f32 = batch.positions.dtype  # float32, or float64 (precision float64)
    n_node = np.zeros(pad_g, np.int64)
    n_edge = np.zeros(pad_g, np.int64)
    n_node[0], n_edge[0] = pad_n, pad_e
    pad_vec = np.zeros((pad_e, 3), f32)
    pad_vec[:, 2] = PADDING_EDGE_LENGTH
    padding = AtomGraphs(
        positions=np.zeros((pad_n, 3), f32),
        numbers=np.zeros(pad_n, np.int64),
        cell=np.repeat(np.eye(3, dtype=f32)[None], pad_g, axis=0),
        senders=np.zeros(pad_e, np.int64),  # local index 0 = the first padding node
        receivers=np.zeros(pad_e, np.int64),
        vectors=pad_vec,
        n_node=n_node,
        n_edge=n_edge,
        energy=None if batch.energy is None else np.zeros(pad_g, f32),
        forces=None if batch.forces is None else np.zeros((pad_n, 3), f32),
        stress=None if batch.stress is None else np.zeros((pad_g, 6), f32),
        system_id=None if batch.system_id is None else np.full(pad_g, -1, np.int64),
        graph_mask=np.zeros(pad_g, bool),
        unit_shifts=pad_vec.copy(),
        charge=None if batch.charge is None else np.zeros(pad_g, f32),
        spin=None if batch.spin is None else np.zeros(pad_g, f32),
        weight=None if batch.weight is None else np.zeros(pad_g, f32),
        head=None if batch.head is None else np.zeros(pad_g, np.int64),
    )
    return batch_graphs([batch, padding])


def unpad_batch(batch: AtomGraphs) -> AtomGraphs:
    """Drop the padding graphs (and their nodes and edges) added by :func:`pad_batch`."""
    real = batch.graph_mask
    if real.all():
        return batch
    if not np.all(real[: real.sum()]):
        raise ValueError("padding graphs must follow the real graphs")
    g, n, e = int(real.sum()), int(batch.n_node[real].sum()), int(batch.n_edge[real].sum())
    return AtomGraphs(
        positions=batch.positions[:n], numbers=batch.numbers[:n], cell=batch.cell[:g],
        senders=batch.senders[:e], receivers=batch.receivers[:e], vectors=batch.vectors[:e],
        n_node=batch.n_node[:g], n_edge=batch.n_edge[:g],
        energy=None if batch.energy is None else batch.energy[:g],
        forces=None if batch.forces is None else batch.forces[:n],
        stress=None if batch.stress is None else batch.stress[:g],
        system_id=None if batch.system_id is None else batch.system_id[:g],
        graph_mask=batch.graph_mask[:g], unit_shifts=batch.unit_shifts[:e],
        charge=None if batch.charge is None else batch.charge[:g],
        spin=None if batch.spin is None else batch.spin[:g],
        weight=None if batch.weight is None else batch.weight[:g],
        head=None if batch.head is None else batch.head[:g],
    )


def split_batch(batch: AtomGraphs) -> List[AtomGraphs]:
    """Split a batch back into its single-structure graphs (padding graphs included)."""
    out = []
    n0 = e0 = 0
    for g in range(batch.num_graphs):
        n1, e1 = n0 + int(batch.n_node[g]), e0 + int(batch.n_edge[g])
        out.append(AtomGraphs(
            positions=batch.positions[n0:n1], numbers=batch.numbers[n0:n1], cell=batch.cell[g:g + 1],
            senders=batch.senders[e0:e1] - n0, receivers=batch.receivers[e0:e1] - n0, vectors=batch.vectors[e0:e1],
            n_node=batch.n_node[g:g + 1], n_edge=batch.n_edge[g:g + 1],
            energy=None if batch.energy is None else batch.energy[g:g + 1],
            forces=None if batch.forces is None else batch.forces[n0:n1],
            stress=None if batch.stress is None else batch.stress[g:g + 1],
            system_id=None if batch.system_id is None else batch.system_id[g:g + 1],
            graph_mask=batch.graph_mask[g:g + 1], unit_shifts=batch.unit_shifts[e0:e1],
            charge=None if batch.charge is None else batch.charge[g:g + 1],
            spin=None if batch.spin is None else batch.spin[g:g + 1],
            weight=None if batch.weight is None else batch.weight[g:g + 1],
            head=None if batch.head is None else batch.head[g:g + 1],
        ))
        n0, e0 = n1, e1
    return out

