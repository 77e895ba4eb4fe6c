"""Atom graphs: orb's periodic k-nearest-neighbour graphs (batching and padding: :mod:`orb.data.batching`).

Two constructions, selected by :class:`GraphSettings` (each model family carries its own):

orb-v2 (orb-models 0.4.2's ``ase_atoms_to_atom_graphs``):

* a structure is periodic iff its cell is not all zero; ``atoms.pbc`` is ignored, as in
  the original (a molecule in a box with ``pbc=False`` but a non-zero cell is periodic);
* periodic positions are wrapped into the cell (float64 fractional coordinates, modulo 1);
* neighbour candidates are the atoms of the 3x3x3 block of cell images only (27 N points),
  so thin cells get the same, not exact, neighbour list as the original;
* each atom takes its ``max_neighbors`` nearest candidates other than itself closer than
  ``radius + 1e-6``; edges are directed sender (centre atom) -> receiver (neighbour) and
  ``vector = receiver image - sender``.

orb-v3 (orb-models 0.5.5, ``minimal_supercell``):

* periodic means a non-zero cell *and* pbc (periodicity along some axes only is refused);
  positions are wrapped in float64, then cast to float32;
* candidates are the images in the exact minimal supercell that can hold a neighbour within
  ``radius`` (6 Å), so thin cells get every neighbour;
* each atom takes its ``max_neighbors`` (20 or 120) nearest candidates other than itself
  within ``radius``; every edge carries the integer cell shift of its receiver's image, from
  which conservative models rebuild the edge vector inside the differentiated graph.

The search itself is :func:`orb.data.neighbours.nearest_images`.
"""

import math
from dataclasses import dataclass, field
from itertools import product
from typing import Optional

import numpy as np

from orb.data.neighbours import minimal_supercell_offsets, nearest_images  # noqa: F401 (graphs' API)
from orb.errors import StructureError

MAX_ATOMIC_NUMBER = 118
# The 27 lattice translations (-1, 0, 1)^3 of the image block; (0, 0, 0) is number 13.
IMAGE_OFFSETS = np.array(list(product((-1.0, 0.0, 1.0), repeat=3)), dtype=np.float32)
# Edge length given to padding edges: beyond orb's 6 Å attention cutoff, so they carry no message.
PADDING_EDGE_LENGTH = 7.0
# A training structure without a stress label among structures with one: its stress row in a batch, finite (not NaN:
# an Ascend training card's saturation mode makes NaN 0, which would read as a label of 0). The losses weigh such a
# row's stress at 0 (MACE's config_stress_weight), as any beyond MISSING_ABOVE. No stored label reaches STRESS_LIMIT
# (the census refuses it: a million eV/Å³, 1.6e8 GPa, is no stress, and squares of larger values in the normaliser's
# sums overflow float32); a rotation (augmentation) or float32 rounding keeps a label far below MISSING_ABOVE.
STRESS_LIMIT = 1e6  # eV/Å³
MISSING_ABOVE = 1e30
MISSING_STRESS = np.full(6, 3e38)  # (within float32's range, above any label)


@dataclass(frozen=True)
class GraphSettings:
    """How a model family builds its graphs."""

    radius: float = 10.0
    max_neighbors: int = 20
    minimal_supercell: bool = False  # orb-v3's construction (see the module docstring)


@dataclass
class AtomGraphs:
    """One structure or a batch of structures as numpy arrays.

    Nodes and edges of all graphs are concatenated; ``senders``/``receivers`` index the
    concatenated nodes. Targets are ``None`` when absent. ``graph_mask`` is False for the
    padding graphs added by :func:`pad_batch`.
    """

    positions: np.ndarray  # (N, 3) float32, wrapped into the cell when periodic
    numbers: np.ndarray  # (N,) int64 atomic numbers (0 marks a padding node)
    cell: np.ndarray  # (B, 3, 3) float32, rows are lattice vectors; all zero = non-periodic
    senders: np.ndarray  # (E,) int64
    receivers: np.ndarray  # (E,) int64
    vectors: np.ndarray  # (E, 3) float32
    n_node: np.ndarray  # (B,) int64
    n_edge: np.ndarray  # (B,) int64
    energy: Optional[np.ndarray] = None  # (B,) float32, eV
    forces: Optional[np.ndarray] = None  # (N, 3) float32, eV/Å
    stress: Optional[np.ndarray] = None  # (B, 6) float32, eV/Å^3, Voigt, ASE sign (MISSING_STRESS: none stored)
    system_id: Optional[np.ndarray] = None  # (B,) int64, e.g. the database row id
    graph_mask: np.ndarray = field(default=None)  # (B,) bool, False for padding graphs
    unit_shifts: np.ndarray = field(default=None)  # (E, 3) float32, integer cell offset of each receiver image
    charge: Optional[np.ndarray] = None  # (B,) float32 total charge (orb-v3 OMol models)
    spin: Optional[np.ndarray] = None  # (B,) float32 total spin (orb-v3 OMol models)
    weight: Optional[np.ndarray] = None  # (B,) float32 weight of each structure in the loss (None: 1)
    head: Optional[np.ndarray] = None  # (B,) int: 0 the model's heads, 1 its replay heads (None: 0)

    def __post_init__(self):
        if self.graph_mask is None:
            self.graph_mask = np.ones(len(self.n_node), dtype=bool)
        if self.unit_shifts is None:
            self.unit_shifts = np.zeros((len(self.senders), 3), np.float32)

    @property
    def num_graphs(self) -> int:
        return int(len(self.n_node))

    @property
    def num_nodes(self) -> int:
        return int(len(self.numbers))

    @property
    def num_edges(self) -> int:
        return int(len(self.senders))

    @property
    def num_real_graphs(self) -> int:
        return int(self.graph_mask.sum())

    @property
    def r(self) -> np.ndarray:
        """Edge lengths (E,)."""
        return np.linalg.norm(self.vectors, axis=1)

    @property
    def node_graph(self) -> np.ndarray:
        """Index of the graph each node belongs to (N,)."""
        return np.repeat(np.arange(self.num_graphs), self.n_node)

    @property
    def node_mask(self) -> np.ndarray:
        """False for padding nodes (N,)."""
        return np.repeat(self.graph_mask, self.n_node)

    @property
    def periodic(self) -> np.ndarray:
        """Per graph: True when the cell is not all zero (B,)."""
        return np.any(self.cell.reshape(-1, 9) != 0, axis=1)


def wrap_positions64(positions: np.ndarray, cell: np.ndarray) -> np.ndarray:
    """Wrap positions into a periodic cell (float64: solve for fractional coordinates, modulo 1)."""
    frac = np.mod(np.linalg.solve(cell.T, positions.T).T, 1.0)
    return frac @ cell


def wrap_positions(positions: np.ndarray, cell: np.ndarray) -> np.ndarray:
    """orb-v2's wrap: float32 positions and cell, computed in float64, back to float32."""
    return wrap_positions64(positions.astype(np.float64), cell.astype(np.float64)).astype(np.float32)


def check_structure(positions: np.ndarray, numbers: np.ndarray, cell: np.ndarray) -> bool:
    """Validate a structure; return whether it is periodic."""
    if positions.ndim != 2 or positions.shape[1] != 3 or len(positions) != len(numbers):
        raise StructureError(f"positions of shape {positions.shape} do not match {len(numbers)} atoms")
    if len(numbers) == 0:
        raise StructureError("structure has no atoms")
    if numbers.min() < 1 or numbers.max() > MAX_ATOMIC_NUMBER:
        bad = (numbers < 1) | (numbers > MAX_ATOMIC_NUMBER)
        i = int(np.argmax(bad))
        raise StructureError(f"atom {i} has atomic number {int(numbers[i])}; orb supports 1..{MAX_ATOMIC_NUMBER}")
    if not np.isfinite(positions).all():
        raise StructureError("positions contain NaN or inf")
    if cell.shape != (3, 3) or not np.isfinite(cell).all():
        raise StructureError(f"cell must be a finite 3x3 matrix, got {cell!r}")
    periodic = bool(cell.any())
    if periodic:
        (a, b, c), (d, e, f), (g, h, i) = cell.astype(np.float64).tolist()
        volume = abs(a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g))
        lengths = [math.sqrt(x * x + y * y + z * z) for x, y, z in ((a, b, c), (d, e, f), (g, h, i))]
        if min(lengths) == 0 or volume < 1e-6 * lengths[0] * lengths[1] * lengths[2]:
            raise StructureError(
                f"periodic structure (non-zero cell) with a singular cell {cell.tolist()}; orb needs "
                "three independent lattice vectors, or an all-zero cell for a non-periodic system"
            )
    return periodic


def knn_edges(positions: np.ndarray, cell: np.ndarray, radius: float, max_neighbors: int):
    """orb-v2's directed k-NN edges among the 27 images: senders, receivers, vectors, unit shifts
    (grouped by sender, nearest first)."""
    if not cell.any():
        zero = np.zeros((1, 3), np.float32)
        return nearest_images(positions, zero, zero, 0, max_neighbors, radius + 1e-6)
    return nearest_images(positions, IMAGE_OFFSETS @ cell, IMAGE_OFFSETS, 13, max_neighbors, radius + 1e-6)


def supercell_edges(positions: np.ndarray, cell: np.ndarray, periodic: bool, radius: float, max_neighbors: int,
                    margin: float = 1e-8):
    """orb-v3's edges: senders, receivers, vectors and unit shifts (float32), grouped by sender, nearest first
    (neighbours closer than ``radius + margin``)."""
    offsets = minimal_supercell_offsets(cell, radius) if periodic else np.zeros((1, 3), np.float32)
    home = int(np.flatnonzero(~offsets.any(axis=1))[0])
    return nearest_images(positions, offsets @ cell, offsets, home, max_neighbors, radius + margin)


def _v3_frame(positions64: np.ndarray, numbers: np.ndarray, cell64: np.ndarray, pbc: Optional[np.ndarray]):
    """orb-v3's checked float32 positions (wrapped in float64 when periodic), float32 cell and periodicity."""
    cell = cell64.astype(np.float32)
    periodic = _checked_periodicity(positions64.astype(np.float32), numbers, cell, pbc, True)
    positions = (wrap_positions64(positions64, cell64) if periodic else positions64).astype(np.float32)
    return positions, cell, periodic


def structure_periodicity(positions, numbers, cell, pbc, settings: "GraphSettings") -> bool:
    """Whether the model of ``settings`` sees a structure as periodic, after every check its graph construction
    makes (the one check of a structure: a data set's census and orb-md's start, before any work, make it as the
    graphs do: orb-v3's periodicity along some axes only was found mid-run, and a molecule without pbc in a
    degenerate box was refused up front though orb-v3 ignores its cell)."""
    return _checked_periodicity(np.asarray(positions, np.float32), np.asarray(numbers).astype(np.int64),
                                _cell64(cell).astype(np.float32), pbc, settings.minimal_supercell)


def _checked_periodicity(positions: np.ndarray, numbers: np.ndarray, cell: np.ndarray, pbc, minimal_supercell: bool
                         ) -> bool:
    """orb-v3: a non-zero cell and pbc (without pbc the cell plays no part: a singular one is no error then);
    orb-v2: a non-zero cell, whatever pbc says (as orb-models 0.4.2)."""
    if minimal_supercell:
        wanted = _check_pbc(pbc, cell)
        return check_structure(positions, numbers, cell if wanted else np.zeros_like(cell))
    try:
        return check_structure(positions, numbers, cell)
    except StructureError as exc:
        if "singular cell" in str(exc) and pbc is not None and not np.any(pbc):
            raise StructureError(f"{exc} (orb-v2 reads any non-zero cell as periodic, whatever its periodic flags: "
                                 "store a molecule with a zero cell)") from None
        raise


def _check_pbc(pbc: Optional[np.ndarray], cell: np.ndarray) -> bool:
    """orb-v3's periodicity: a non-zero cell and pbc; refuses periodicity along some axes only."""
    pbc = np.zeros(3, bool) if pbc is None else np.broadcast_to(np.asarray(pbc, bool), (3,))
    if pbc.any() and not pbc.all():
        raise StructureError(f"periodic along some axes only (pbc {pbc.tolist()}) is not supported; set pbc on all "
                             "three axes (pad with vacuum) or none")
    return bool(cell.any() and pbc.any())


def model_sees_periodic(atoms, settings: "GraphSettings") -> bool:
    """Whether orb's graph of ``atoms`` is periodic: orb-v2 whenever the cell is non-zero (as orb-models 0.4.2,
    whatever ``pbc`` says), orb-v3 when the cell is non-zero and ``pbc`` is set (what :func:`graph_from_arrays`
    builds); what a term added to the model's (DFT-D3) must use too."""
    cell = _cell64(atoms.cell.array).astype(np.float32)
    if settings.minimal_supercell:
        return _check_pbc(atoms.pbc, cell)
    return bool(cell.any())


def graph_from_arrays(
    positions: np.ndarray,
    numbers: np.ndarray,
    cell: np.ndarray,
    radius: float = 10.0,
    max_neighbors: int = 20,
    system_id: Optional[int] = None,
    pbc: Optional[np.ndarray] = None,
    settings: Optional[GraphSettings] = None,
    float64: bool = False,
) -> AtomGraphs:
    """Build orb's graph from raw arrays (positions Å, atomic numbers, cell rows, pbc flags).

    ``settings`` (default: orb-v2's construction with ``radius`` and ``max_neighbors``) selects
    the construction; ``pbc`` matters to orb-v3 only. ``float64`` (precision float64): the same edges, with
    positions (wrapped in float64), cell, edge vectors and unit shifts in float64.
    """
    settings = settings or GraphSettings(radius, max_neighbors)
    positions64 = np.asarray(positions, dtype=np.float64)
    numbers = np.asarray(numbers).astype(np.int64)
    cell64 = _cell64(cell)
    cell = cell64.astype(np.float32)
    if settings.minimal_supercell:
        positions, cell, periodic = _v3_frame(positions64, numbers, cell64, pbc)
        senders, receivers, vectors, shifts = supercell_edges(positions, cell, periodic, settings.radius,
                                                              settings.max_neighbors)
    else:
        positions = positions64.astype(np.float32)
        periodic = _checked_periodicity(positions, numbers, cell, pbc, False)
        if periodic:
            positions = wrap_positions(positions, cell)
        senders, receivers, vectors, shifts = knn_edges(positions, cell, settings.radius, settings.max_neighbors)
    if float64:  # the images the search chose: each atom moved by the lattice vectors its float32 wrap moved it
        if periodic:
            moved = np.rint((positions.astype(np.float64) - positions64) @ np.linalg.inv(cell64))
            positions64 = positions64 + moved @ cell64
        positions, cell = positions64, cell64
        shifts = shifts.astype(np.float64)
        vectors = positions[receivers] + shifts @ cell64 - positions[senders]
    check_no_overlap(senders, receivers, vectors)
    return AtomGraphs(
        positions=positions,
        numbers=numbers,
        cell=cell[None],
        senders=senders,
        receivers=receivers,
        vectors=vectors.astype(positions.dtype),
        n_node=np.array([len(numbers)], np.int64),
        n_edge=np.array([len(senders)], np.int64),
        system_id=None if system_id is None else np.array([system_id], np.int64),
        unit_shifts=shifts.astype(positions.dtype),
    )


OVERLAP = 0.1  # Å: atoms closer than this are taken to be on top of each other (no model describes them)
CLOSE = 0.5  # Å: closer than any bond (H2's is 0.74 Å): positions in nm, or fractional coordinates read as Å


def check_no_overlap(senders: np.ndarray, receivers: np.ndarray, vectors: np.ndarray) -> None:
    """Refuse a structure with two atoms closer than OVERLAP, naming them: its graph would have an edge of (near)
    zero length, whose direction is NaN (a NaN loss, a NaN validation, a structure relaxed apart from 0.02 Å)."""
    if not len(vectors):
        return
    lengths = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64))
    e = int(np.argmin(lengths))
    if lengths[e] < OVERLAP:
        raise StructureError(f"atoms {senders[e]} and {receivers[e]} are {lengths[e]:.2g} Å apart (on top of each "
                             "other)")


def check_no_overlap_before_graphs(positions: np.ndarray, cell: np.ndarray, periodic: bool) -> Optional[tuple]:
    """:func:`check_no_overlap` without building the model's graph (the census of a database, before training): the
    native search among the 27 images for each atom's nearest neighbour within CLOSE (22-192 µs for 10-444 atoms:
    docs/benchmarks.md).
    Returns the closest pair (atom, atom, Å) if it is nearer than CLOSE, else None."""
    positions = np.asarray(positions, np.float32)
    cell = np.asarray(cell, np.float32) if periodic else np.zeros((3, 3), np.float32)
    if periodic:
        positions = wrap_positions(positions, cell)
    senders, receivers, vectors, _ = knn_edges(positions, cell, CLOSE, 1)
    check_no_overlap(senders, receivers, vectors)
    if not len(vectors):
        return None
    lengths = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64))
    e = int(np.argmin(lengths))
    return (int(senders[e]), int(receivers[e]), float(lengths[e])) if lengths[e] < CLOSE else None


# Distances move by float32 rounding (~1e-6 Å) when a structure is rotated (augmentation) and
# re-wrapped; counting neighbours this much beyond the radius bounds every rotation's edge count.
EDGE_CAPACITY_MARGIN = 1e-3


def capacity_is_counted(settings: GraphSettings) -> bool:
    """Whether a structure's edge capacity needs a neighbour search (else it is atoms x ``max_neighbors``).

    orb-v3 graphs hold every neighbour within the radius (up to ``max_neighbors`` per atom), so the
    capacity is that count: for "inf" models typically 2-3x below atoms x 120 in crystals and
    further below in molecules, which is what the padded batch shapes then cost. orb-v2's 27-image
    candidates change when a rotation wraps an atom across the cell, so no count bounds them.
    """
    return settings.minimal_supercell


def edge_capacity(positions: np.ndarray, numbers: np.ndarray, cell: np.ndarray, pbc: Optional[np.ndarray],
                  settings: GraphSettings) -> int:
    """An upper bound on the edges of this structure's graph, however it is rotated: counted at the
    radius plus :data:`EDGE_CAPACITY_MARGIN` where :func:`capacity_is_counted`, else atoms x k."""
    numbers = np.asarray(numbers).astype(np.int64)
    if not capacity_is_counted(settings):
        return len(numbers) * settings.max_neighbors
    positions, cell, periodic = _v3_frame(np.asarray(positions, dtype=np.float64), numbers, _cell64(cell), pbc)
    senders = supercell_edges(positions, cell, periodic, settings.radius, settings.max_neighbors,
                              margin=EDGE_CAPACITY_MARGIN)[0]
    return len(senders)


def _cell64(cell) -> np.ndarray:
    return np.asarray(cell, dtype=np.float64).reshape(3, 3) if np.size(cell) else np.zeros((3, 3))


def atoms_to_graph(atoms, radius: float = 10.0, max_neighbors: int = 20, system_id: Optional[int] = None,
                   settings: Optional[GraphSettings] = None, float64: bool = False) -> AtomGraphs:
    """Build orb's graph of an ``ase.Atoms`` (labels are not attached; see ``orb.data.dataset``).

    ``atoms.info["charge"]`` and ``atoms.info["spin"]``, when present, are kept for OMol models.
    """
    graph = graph_from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, radius, max_neighbors, system_id,
                              pbc=atoms.pbc, settings=settings, float64=float64)
    for key in ("charge", "spin"):
        if key in atoms.info:
            try:
                value = total_charge_or_spin(atoms.info[key])
            except ValueError as exc:
                raise StructureError(f"atoms.info['{key}'] {exc}") from None
            setattr(graph, key, np.array([value], np.float32))
    return graph


def total_charge_or_spin(value) -> float:
    """A structure's total charge or spin as a finite number; ValueError saying what it is instead (the caller
    names where it was read)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be a number, got {str(value)[:40]!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"must be finite, got {number}")
    return number
