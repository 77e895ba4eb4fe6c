"""Graph construction against orb-models 0.4.2's stored graphs and ASE's neighbour list."""

import os
import shutil

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.neighborlist import neighbor_list

from orb.data.samplers import EpochSampler
from orb.data.buckets import Bucket, assign_buckets, check_buckets, largest_batch, pad_to_bucket, plan_buckets
from orb.errors import ConfigError, StructureError
from orb.data.batching import batch_graphs, pad_batch, split_batch, unpad_batch
from orb.data.graphs import PADDING_EDGE_LENGTH, atoms_to_graph, graph_from_arrays, wrap_positions


def edge_sets(senders, receivers, vectors, atom):
    sel = senders == atom
    return sorted((int(r), *np.round(v, 4)) for r, v in zip(receivers[sel], vectors[sel]))


@pytest.mark.parametrize("i", range(8))
def test_reference_graphs(reference, i):
    """Same edges per sender as pynanoflann in orb-models (up to documented exact ties), vectors within 1e-5 Å."""
    z, p = reference, f"s{i}/"
    g = graph_from_arrays(z[p + "positions_input"], z[p + "numbers"], z[p + "cell_input"])
    np.testing.assert_array_equal(g.positions, z[p + "positions"])
    assert g.num_edges == len(z[p + "senders"])
    gaps = z[p + "knn_gap"]
    for atom in range(g.num_nodes):
        mine = edge_sets(g.senders, g.receivers, g.vectors, atom)
        ref = edge_sets(z[p + "senders"], z[p + "receivers"], z[p + "vectors"], atom)
        if gaps[atom] < 1e-4:  # tie at the 20th neighbour: the last edge may legitimately differ
            assert len(mine) == len(ref)
            assert len(set(mine) ^ set(ref)) <= 4
            continue
        assert len(mine) == len(ref)
        for (r1, *v1), (r2, *v2) in zip(mine, ref):
            assert r1 == r2
            np.testing.assert_allclose(v1, v2, atol=1e-5)
    # vectors are receiver image minus sender, lengths consistent
    np.testing.assert_allclose(g.r, np.linalg.norm(g.vectors, axis=1))
    assert np.all(g.r < 10.0 + 1e-6)


def exhaustive_27_image_graph(atoms, radius, k):
    """Brute force over the 3x3x3 images with ASE's own neighbour list machinery (no cut at k)."""
    cell = atoms.cell.array
    pos = wrap_positions(atoms.positions.astype(np.float32), cell.astype(np.float32)).astype(np.float64)
    big = Atoms(numbers=np.tile(atoms.numbers, 27), cell=cell * 3, pbc=False,
                positions=np.concatenate([pos + np.array(o) @ cell for o in np.ndindex(3, 3, 3)]) - cell.sum(0))
    n = len(atoms)
    i, j, d = neighbor_list("ijd", big, radius)
    centre = 13 * n  # the (0,0,0) image block: index (1,1,1) in ndindex order
    out = {}
    for a in range(n):
        sel = i == centre + a
        order = np.argsort(d[sel], kind="stable")[:k]
        out[a] = sorted(int(x) % n for x in j[sel][order])
    return out


def test_rattled_structure_matches_ase_neighbour_list():
    atoms = bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2))
    atoms.rattle(0.1, seed=3)
    g = atoms_to_graph(atoms)
    expected = exhaustive_27_image_graph(atoms, 10.0, 20)
    for a in range(len(atoms)):
        assert sorted(g.receivers[g.senders == a].tolist()) == expected[a]


def test_thin_cell_uses_27_images_like_orb(reference):
    """Structure 2 (2.78 Å cell): our graph equals orb's 27-image one, not an exact neighbour list."""
    z = reference
    g = graph_from_arrays(z["s2/positions_input"], z["s2/numbers"], z["s2/cell_input"])
    assert g.num_edges == 80
    cutoff = neighbor_list("i", Atoms(numbers=z["s2/numbers"], positions=z["s2/positions"],
                                      cell=z["s2/cell"], pbc=True), 10.0)
    assert len(cutoff) > 80  # a true neighbour list is much larger: only the 20 nearest of 27 images are kept


def test_non_periodic_and_isolated_atom():
    atoms = Atoms("Cu3", positions=[[0, 0, 0], [2.5, 0, 0], [30, 0, 0]])
    g = atoms_to_graph(atoms)
    assert g.periodic.tolist() == [False]
    assert sorted(zip(g.senders.tolist(), g.receivers.tolist())) == [(0, 1), (1, 0)]
    assert 2 not in g.senders and 2 not in g.receivers  # no neighbour within 10 Å: no edge


def test_pbc_flags_are_ignored_like_orb():
    atoms = Atoms("Cu", positions=[[0, 0, 0]], cell=np.eye(3) * 3.0, pbc=False)
    assert atoms_to_graph(atoms).num_edges == 20  # non-zero cell => periodic


@pytest.mark.parametrize("numbers, message", [([0, 29], "atomic number 0"), ([29, 119], "atomic number 119")])
def test_bad_atomic_numbers(numbers, message):
    with pytest.raises(StructureError, match=message):
        graph_from_arrays(np.zeros((2, 3)) + [[0, 0, 0], [1, 1, 1]], numbers, np.zeros((3, 3)))


def test_singular_cell_and_nan_positions():
    with pytest.raises(StructureError, match="singular cell"):
        graph_from_arrays([[0, 0, 0]], [29], [[3, 0, 0], [0, 3, 0], [0, 0, 0]])
    with pytest.raises(StructureError, match="NaN"):
        graph_from_arrays([[0, np.nan, 0]], [29], np.eye(3) * 3)


def test_batch_pad_unpad_round_trip(reference):
    from conftest import reference_graph

    graphs = [reference_graph(reference, i) for i in (0, 1, 4)]
    batch = batch_graphs(graphs)
    assert batch.num_nodes == sum(g.num_nodes for g in graphs)
    np.testing.assert_array_equal(batch.senders[640:640 + 156], graphs[1].senders + 32)
    padded = pad_batch(batch, batch.num_nodes + 7, batch.num_edges + 30, batch.num_graphs + 2)
    assert padded.num_graphs == 5 and padded.graph_mask.tolist() == [True, True, True, False, False]
    assert padded.numbers[-7:].tolist() == [0] * 7
    # padding edges join padding nodes only, and are longer than the 6 Å attention cutoff
    pad_e = slice(batch.num_edges, None)
    assert np.all(padded.senders[pad_e] >= batch.num_nodes) and np.all(padded.receivers[pad_e] >= batch.num_nodes)
    np.testing.assert_allclose(padded.r[pad_e], PADDING_EDGE_LENGTH)
    # real nodes keep exactly their neighbourhoods
    for a in range(batch.num_nodes):
        assert edge_sets(padded.senders, padded.receivers, padded.vectors, a) == \
            edge_sets(batch.senders, batch.receivers, batch.vectors, a)
    back = unpad_batch(padded)
    for name in ("positions", "numbers", "cell", "senders", "receivers", "vectors", "n_node", "n_edge",
                 "energy", "forces", "stress"):
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name))
    parts = split_batch(batch)
    for g, part in zip(graphs, parts):
        np.testing.assert_array_equal(part.senders, g.senders)
        np.testing.assert_array_equal(part.vectors, g.vectors)


def test_pad_refuses_too_small():
    g = atoms_to_graph(bulk("Cu", "fcc", a=3.6))
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(g, 0, 0, 1)


def brute_force_best(totals, max_buckets):
    """The planner's objective (padded edges of the sample steps) minimised by trying every subset of the
    candidate edge capacities that includes the largest."""
    from itertools import combinations

    from orb.data.buckets import candidate_caps

    caps = list(candidate_caps(np.sort(totals), 8))
    best = None
    for n in range(max_buckets):
        for chosen in combinations(caps[:-1], n):
            sizes = np.array(sorted(chosen) + [caps[-1]])
            cost = sizes[np.searchsorted(sizes, totals)].sum()
            best = cost if best is None else min(best, cost)
    return best


def sample_steps(natoms, edges, batch_size, epochs=3, world=1):
    from orb.data.plan import StepTotals, step_totals

    sampler = EpochSampler(len(natoms), batch_size * world, seed=0)
    return StepTotals.concatenate([step_totals(sampler.shards(e, world), natoms, edges) for e in range(epochs)])


def test_buckets_fit_every_batch_and_are_few():
    rng = np.random.default_rng(0)
    natoms = rng.choice([4, 8, 13, 16, 32], size=200)
    edges = natoms * rng.integers(5, 60, size=200)  # per-structure edge capacities, not proportional to atoms
    sample = sample_steps(natoms, edges, 8)
    worst = largest_batch(natoms, edges, 8)
    for max_buckets in (1, 2, 3, 4):
        buckets = plan_buckets(sample.nodes, sample.edges, 9, worst, max_buckets)
        planned = [b for b in buckets if not b.spare]
        assert 1 <= len(planned) <= max_buckets and len(buckets) - len(planned) <= 1
        assert planned[-1].num_edges == round_up_8(sample.edges.max())  # the tail resolved to the largest step
        spare = buckets[-1]  # holds the 8 largest structures by atoms and by edges
        assert spare.num_nodes > worst[0] and spare.num_edges >= worst[1]
        chosen = assign_buckets(sample.nodes, sample.edges, sample.graphs, planned)  # every sample step fits
        assert all(planned[c].holds(n, e, g) for c, n, e, g in zip(chosen, sample.nodes, sample.edges, sample.graphs))
        for c, n, e in zip(chosen, sample.nodes, sample.edges):  # ... the smallest that holds it
            assert not any(b.holds(n, e, 1) for b in planned if b.num_edges < planned[c].num_edges)
        cost = sum(planned[c].num_edges for c in chosen)
        assert cost == brute_force_best(sample.edges, max_buckets)  # the dynamic programme is optimal
    big_natoms = rng.integers(1, 300, size=5000)
    big = sample_steps(big_natoms, 20 * big_natoms, 32)
    assert len(plan_buckets(big.nodes, big.edges, 33, largest_batch(big_natoms, 20 * big_natoms, 32), 16)) <= 17
    cu = atoms_to_graph(bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2)))
    batch = batch_graphs([cu] * 8)
    bucket = buckets[int(assign_buckets([64], [1280], [8], buckets)[0])]
    assert bucket.fits(batch) and pad_to_bucket(batch, bucket).num_nodes == bucket.num_nodes
    with pytest.raises(ConfigError, match="fits no bucket"):
        assign_buckets([64], [1280], [8], [Bucket(16, 320, 9)])
    with pytest.raises(ConfigError, match="largest bucket \\[64, 640\\] cannot hold"):
        check_buckets(natoms, edges, 8, [Bucket(64, 640, 9)], "training")


def round_up_8(x):
    return int(-(-int(x) // 8) * 8)


def test_bucket_count_chosen_from_the_run_length_and_tails_kept_tight():
    """``num_buckets: 0`` weighs padding against compilations: a short run compiles few shapes, a long one more
    and pads less; on an MPtrj-like size distribution (log-normal, median 20 atoms, a tail to 444) the
    planned buckets pad orb-v2's edges by at most 1.25x at 8 structures per device, on epochs not planned on
    too, where the old 5-95 % quantile planner with a worst-case top bucket padded 1.9x."""
    from orb.data.plan import padding_ratio

    rng = np.random.default_rng(1)
    natoms = np.clip(np.rint(np.exp(rng.normal(np.log(20), 0.86, 20000))), 1, 444).astype(np.int64)
    natoms[:3] = 444
    edges = 20 * natoms
    sample = sample_steps(natoms, edges, 8, epochs=2)
    worst = largest_batch(natoms, edges, 8)
    short = plan_buckets(sample.nodes, sample.edges, 9, worst, 0, run_steps=500)
    long = plan_buckets(sample.nodes, sample.edges, 9, worst, 0, run_steps=2_000_000)
    assert len([b for b in short if not b.spare]) < len([b for b in long if not b.spare])
    later = sample_steps(natoms, edges, 8, epochs=5)  # epochs 3-5 were not planned on
    assert padding_ratio(later, long, 1)[1] <= 1.25
    assert padding_ratio(later, short, 1)[1] > padding_ratio(later, long, 1)[1]
    assert long[-1].spare and long[-1].num_edges >= worst[1]  # the worst case stays possible, not planned for


@pytest.mark.parametrize("name", ["orb_v3_conservative_inf_omat", "orb_v3_direct_20_omat", "orb_v2"])
def test_edge_capacity_bounds_every_rotation(name):
    """A row's edge capacity is at least its graph's edges under every augmentation rotation; for
    orb-v3 it is the neighbour count (so 120-neighbour buckets are sized by the real graphs, not by
    atoms x 120), for orb-v2 atoms x 20."""
    from conftest import DEMO_TRAIN, MPTRJ_DB, MPTRJ_THIN_DB
    from orb.data.dataset import AseDbDataset
    from orb.models.config import ModelConfig

    settings = ModelConfig.from_dict(dict(name=name)).graph_settings()
    for path in (MPTRJ_THIN_DB, MPTRJ_DB, DEMO_TRAIN):
        ds = AseDbDataset(path, settings=settings, augmentation=True)
        capacity = ds.count_edge_capacities(0, len(ds))  # counted here, never from a cache of an older count
        unrotated = np.array([ds.get(i, rotation_seed=None).num_edges for i in range(len(ds))])
        if settings.minimal_supercell:
            assert (capacity - unrotated).max() <= 0.01 * unrotated.max()  # tight: the neighbour count itself
        else:
            np.testing.assert_array_equal(capacity, ds.natoms * 20)
        for i in range(len(ds)):
            for seed in range(4):
                assert ds.get(i, rotation_seed=[seed, 0, i]).num_edges <= capacity[i]
    if "inf" in name:  # what the buckets gain: crystals have ~50-65 neighbours within 6 Å, not 120
        assert capacity.sum() < 0.6 * 120 * ds.natoms.sum()


def test_edge_capacities_counted_by_workers_equal_the_serial_count(monkeypatch, tmp_path):
    from conftest import DEMO_TRAIN
    from orb.data.dataset import AseDbDataset
    from orb.data.loader import BatchLoader
    from orb.models.config import ModelConfig

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))  # counted, not read from an earlier run
    settings = ModelConfig.from_dict(dict(name="orb_v3_direct_inf_omat")).graph_settings()
    serial = AseDbDataset(DEMO_TRAIN, settings=settings).count_edge_capacities(0, 64)
    loader = BatchLoader({"train": AseDbDataset(DEMO_TRAIN, settings=settings)}, workers=2)
    try:
        counted = loader.edge_capacities("train", chunk=10)  # 7 chunks over 2 processes
    finally:
        loader.close()
    np.testing.assert_array_equal(counted, serial)
    assert loader.datasets["train"].edge_capacities() is counted  # kept: the buckets and the epochs use it
    assert loader.datasets["train"].capacities_read_from is None


def _copy_db(source: str, target: str) -> str:
    import ase.db

    with ase.db.connect(source) as src, ase.db.connect(target) as dst:
        for row in src.select():
            atoms = row.toatoms()
            atoms.calc = None  # unlabelled: the counts need structures only
            dst.write(atoms)
    return target


def test_neighbour_counts_are_kept_per_database_and_settings(monkeypatch, tmp_path, caplog):
    """Counted once (by the data workers, as training does), kept in the cache, read back at the next
    start without a count or a worker pool (also from a copy that keeps the modification time);
    missed when the database or the graph settings change;
    a damaged cache file is counted again; an unwritable cache warns once and still counts."""
    import ase.db

    from orb.data.dataset import AseDbDataset
    from orb.data.loader import BatchLoader
    from orb.models.config import ModelConfig
    from conftest import MPTRJ_DB

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    inf = ModelConfig.from_dict(dict(name="orb_v3_conservative_inf_omat")).graph_settings()
    twenty = ModelConfig.from_dict(dict(name="orb_v3_direct_20_omat")).graph_settings()
    path = _copy_db(MPTRJ_DB, str(tmp_path / "data.db"))

    def capacities(settings, workers=0):
        loader = BatchLoader({"train": AseDbDataset(path, settings=settings, require_labels=False)}, workers)
        try:
            return loader.edge_capacities("train", chunk=4), loader.datasets["train"]
        finally:
            loader.close()

    counted, first = capacities(inf, workers=2)
    assert first.capacities_read_from is None and first.capacities_kept_in.startswith(str(tmp_path / "cache"))
    np.testing.assert_array_equal(counted, first.count_edge_capacities(0, len(first)))

    again, second = capacities(inf, workers=2)
    np.testing.assert_array_equal(again, counted)
    assert second.capacities_read_from == first.capacities_kept_in and second.capacities_kept_in is None
    staged = str(tmp_path / "scratch" / "data.db")  # the same data elsewhere (rsync -a, cp -p): read back
    os.makedirs(os.path.dirname(staged))
    shutil.copy2(path, staged)
    loader = BatchLoader({"train": AseDbDataset(staged, settings=inf, require_labels=False)}, 0)
    np.testing.assert_array_equal(loader.edge_capacities("train"), counted)
    assert loader.datasets["train"].capacities_read_from == first.capacities_kept_in

    _, changed = capacities(twenty)  # other settings: other graphs, counted
    assert changed.capacities_read_from is None and changed.capacities_kept_in != first.capacities_kept_in
    with open(first.capacities_kept_in, "wb") as f:
        f.write(b"not an array")
    again, damaged = capacities(inf)
    np.testing.assert_array_equal(again, counted)
    assert damaged.capacities_read_from is None and damaged.capacities_kept_in == first.capacities_kept_in

    with ase.db.connect(path) as db:
        db.write(bulk("Cu", "fcc", a=3.6))  # the same file, one more row
    grown, after = capacities(inf)
    assert after.capacities_read_from is None and len(grown) == len(counted) + 1
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))  # rewritten in place
    assert capacities(inf)[1].capacities_read_from is None

    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("ORB_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("TMPDIR", str(blocker / "tmp"))
    with caplog.at_level("WARNING", logger="orb"):
        unkept, dataset = capacities(inf)
    np.testing.assert_array_equal(unkept, grown)
    assert dataset.capacities_kept_in is None and "ORB_CACHE_DIR" in caplog.text


V3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "orb_v3_parity.npz")


@pytest.mark.parametrize("k", [20, 120])
def test_orb_v3_graphs_match_orb_models_055(k):
    """orb-v3's construction (exact minimal supercell, float64 wrap, unit shifts, radius 6) against the
    stored orb-models 0.5.5 graphs: the same edges per sender with the same image, vectors to 1e-5 Å;
    only atoms with a near-tie at the k-th neighbour or the radius (gap < 1e-4 Å) may differ."""
    from orb.data.graphs import GraphSettings, graph_from_arrays

    z = np.load(V3)
    settings = GraphSettings(radius=6.0, max_neighbors=k, minimal_supercell=True)
    for name in [f"s{i}" for i in range(8)] + ["probe/p0", "probe/p1"]:
        ref = f"graph/nn{k}/{name.split('/')[-1]}/"
        g = graph_from_arrays(z[name + "/positions_input"], z[name + "/numbers"], z[name + "/cell_input"],
                              pbc=z[name + "/pbc"], settings=settings)
        np.testing.assert_array_equal(g.positions, z[name + "/positions"], err_msg=name)  # float64 wrap, then cast
        ambiguous = (z[ref + "knn_gap"] < 1e-4) | (z[ref + "radius_margin"] < 1e-4)
        ours = edges_by_sender(g.senders, g.receivers, g.unit_shifts, g.vectors)
        theirs = edges_by_sender(z[ref + "senders"], z[ref + "receivers"], z[ref + "unit_shifts"], z[ref + "vectors"])
        for atom in range(len(z[name + "/numbers"])):
            if ambiguous[atom]:
                continue
            assert ours.get(atom, {}).keys() == theirs.get(atom, {}).keys(), (name, atom)
            for edge, vector in theirs[atom].items():
                np.testing.assert_allclose(ours[atom][edge], vector, atol=1e-5, err_msg=(name, atom))
        assert g.num_edges == len(z[ref + "senders"]) or ambiguous.any(), name


def edges_by_sender(senders, receivers, shifts, vectors):
    out = {}
    for s, r, shift, v in zip(senders, receivers, shifts, vectors):
        out.setdefault(int(s), {})[(int(r),) + tuple(int(round(x)) for x in shift)] = v
    return {a: out.get(a, {}) for a in range(max(out) + 1 if out else 0)}


def test_orb_v3_periodicity_rules():
    from ase import Atoms
    from ase.build import bulk

    from orb.data.graphs import GraphSettings, atoms_to_graph

    v3 = GraphSettings(radius=6.0, max_neighbors=20, minimal_supercell=True)
    boxed = Atoms("Cu2", positions=[[0, 0, 0], [2.5, 0, 0]], cell=np.eye(3) * 3.0, pbc=False)
    assert atoms_to_graph(boxed, settings=v3).num_edges == 2  # a box without pbc is not periodic in orb-v3 ...
    assert atoms_to_graph(boxed).num_edges > 2  # ... while orb-v2 looks at the cell only
    slab = bulk("Cu", "fcc", a=3.6)
    slab.pbc = [True, True, False]
    with pytest.raises(StructureError, match="periodic along some axes only"):
        atoms_to_graph(slab, settings=v3)
    thin = bulk("Cu", "fcc", a=3.6)
    g = atoms_to_graph(thin, settings=v3)
    assert g.num_edges == 20 and np.all(np.linalg.norm(g.vectors, axis=1) <= 6.0)
    np.testing.assert_allclose(g.vectors, g.positions[g.receivers] - g.positions[g.senders] + g.unit_shifts @ g.cell[0],
                               atol=1e-5)  # edge vectors are rebuilt from positions, cell and unit shifts


def search_cases():
    """Structures for the neighbour search: MPtrj rows (thin cells too), perfect crystals (many exactly
    equidistant neighbours), a large supercell, a flat molecule, far-apart atoms and a lone atom."""
    import ase.db
    from ase import Atoms
    from ase.build import bulk, graphene, molecule

    from conftest import MPTRJ_DB, MPTRJ_THIN_DB

    cases = [row.toatoms() for db in (MPTRJ_DB, MPTRJ_THIN_DB) for row in ase.db.connect(db).select()]
    big = bulk("Cu", "fcc", a=3.6).repeat((4, 4, 4))
    big.rattle(0.05, seed=1)
    sheet = graphene(size=(4, 4, 1))
    sheet.cell[:] = 0.0
    sheet.pbc = False
    return cases + [bulk("Cu", "fcc", a=3.6), bulk("Si", cubic=True).repeat((2, 1, 1)), big, sheet,
                    molecule("C6H6"), Atoms("H2", positions=[[0, 0, 0], [0, 0, 9.5]]), Atoms("H")]


def exhaustive_nearest(positions, translations, shifts, self_image, k, cutoff):
    """Every candidate's squared distance (float64, as the search computes it), the k nearest below the
    cutoff per atom ordered by (distance, candidate index): what the native search must return exactly."""
    n = len(positions)
    candidates = (positions[None, :, :] + translations[:, None, :]).reshape(-1, 3)
    e = candidates[None, :, :].astype(np.float64) - positions[:, None, :].astype(np.float64)
    d2 = e[..., 0] * e[..., 0] + e[..., 1] * e[..., 1] + e[..., 2] * e[..., 2]
    senders, images = [], []
    for i in range(n):
        order = np.lexsort((np.arange(len(candidates)), d2[i]))
        order = order[(order != self_image * n + i) & (d2[i, order] < cutoff * cutoff)][:k]
        senders += [i] * len(order)
        images += order.tolist()
    senders, images = np.array(senders, np.int64), np.array(images, np.int64)
    return senders, images % n, candidates[images] - positions[senders], shifts[images // n]


def search_of(graph, settings):
    """The neighbour search a graph was built from, by its construction's definition: its positions, the
    translations and integer shifts of the cell images searched, the home image, k and the cutoff."""
    from orb.data.graphs import IMAGE_OFFSETS, minimal_supercell_offsets

    positions, cell = graph.positions.astype(np.float32), graph.cell[0].astype(np.float32)
    zero = np.zeros((1, 3), np.float32)
    if not settings.minimal_supercell:
        if not cell.any():
            return positions, zero, zero, 0, settings.max_neighbors, settings.radius + 1e-6
        return positions, IMAGE_OFFSETS @ cell, IMAGE_OFFSETS, 13, settings.max_neighbors, settings.radius + 1e-6
    offsets = minimal_supercell_offsets(cell, settings.radius) if bool(graph.periodic[0]) else zero
    home = int(np.flatnonzero(~offsets.any(axis=1))[0])
    return positions, offsets @ cell, offsets, home, settings.max_neighbors, settings.radius + 1e-8


@pytest.mark.parametrize("construction", ["orb_v2", "orb_v3_20", "orb_v3_120"])
def test_native_neighbour_search_is_exact(construction):
    """The compiled cell-list search returns exactly the exhaustive answer, equal distances ordered by
    candidate index; scipy's k-d tree (used without a compiler) returns the same edges up to such ties."""
    from orb.data import neighbours
    from orb.data.graphs import IMAGE_OFFSETS, GraphSettings, atoms_to_graph, minimal_supercell_offsets

    assert neighbours.native_search() is not None, "a C++ compiler is part of the test environment"
    settings = {"orb_v2": GraphSettings(), "orb_v3_20": GraphSettings(6.0, 20, True),
                "orb_v3_120": GraphSettings(6.0, 120, True)}[construction]
    for atoms in search_cases():
        g = atoms_to_graph(atoms, settings=settings)
        positions, translations, shifts, self_image, k, cutoff = search_of(g, settings)
        if construction == "orb_v2" and atoms.cell.any():
            assert self_image == 13 and np.array_equal(shifts, IMAGE_OFFSETS)
        elif construction != "orb_v2" and atoms.pbc.all():
            assert np.array_equal(shifts, minimal_supercell_offsets(atoms.cell.array.astype(np.float32), 6.0))
        expected = exhaustive_nearest(positions, translations, shifts, self_image, k, cutoff)
        for name, mine, exact in zip(("senders", "receivers", "vectors", "unit shifts"),
                                     (g.senders, g.receivers, g.vectors, g.unit_shifts), expected):
            np.testing.assert_array_equal(mine, exact, err_msg=f"{atoms.get_chemical_formula()}: {name}")
        tree = neighbours.tree_edges(positions, translations, shifts, self_image, k, cutoff)
        assert np.array_equal(tree[0], g.senders)  # the same number of edges per atom
        for atom in range(len(atoms)):
            mine = np.linalg.norm(g.vectors[g.senders == atom].astype(np.float64), axis=1)
            theirs = np.linalg.norm(tree[2][tree[0] == atom].astype(np.float64), axis=1)
            np.testing.assert_allclose(np.sort(mine), np.sort(theirs), atol=1e-6)  # same distances: differ by ties
            nearer = mine < mine.max() - 1e-6 if len(mine) else mine.astype(bool)  # clear of the k-th's ties
            same = {(int(r), *s) for r, s in zip(g.receivers[g.senders == atom][nearer],
                                                 g.unit_shifts[g.senders == atom][nearer])}
            assert same <= {(int(r), *s) for r, s in zip(tree[1][tree[0] == atom], tree[3][tree[0] == atom])}


def test_graphs_build_without_a_compiler(monkeypatch, caplog):
    """Without the compiled search (no g++), graphs come from scipy's k-d tree, with one warning saying so."""
    from orb import native
    from orb.data import neighbours
    from orb.data.graphs import atoms_to_graph

    native_graph = atoms_to_graph(bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2)))
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    for key in ("ORB_CACHE_DIR", "ORB_COMPILE_CACHE_DIR"):
        monkeypatch.setenv(key, str(os.path.join(os.sep, "nonexistent", "cache")))
    monkeypatch.setenv("TMPDIR", os.path.join(os.sep, "nonexistent", "tmp"))
    native.build.cache_clear()
    neighbours.native_search.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="orb"):
            assert neighbours.native_search() is None
        assert "k-d tree" in caplog.text and "g++" in caplog.text
        graph = atoms_to_graph(bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2)))
        assert np.array_equal(graph.senders, native_graph.senders)
        np.testing.assert_allclose(np.sort(graph.r), np.sort(native_graph.r), atol=1e-6)  # ties may differ
    finally:
        native.build.cache_clear()
        neighbours.native_search.cache_clear()


class _ThreadRanks:
    """Ranks of a data-parallel run as threads: ``sum`` is a real all-reduce (every rank waits for all)."""

    def __init__(self, rank: int, world_size: int, board: dict, barrier):
        self.rank, self.world_size, self.board, self.barrier = rank, world_size, board, barrier

    def sum(self, values):
        self.board[self.rank] = np.asarray(values, np.float64)
        self.barrier.wait()
        total = sum(self.board[r] for r in range(self.world_size))
        self.barrier.wait()  # nobody deposits the next values before all have read these
        return total

    sum_shares = sum


def test_ranks_share_the_neighbour_count(monkeypatch, tmp_path):
    """In a data-parallel run each rank counts only its share of the rows, and every rank ends with the
    whole count (the serial one); the next start reads it back on every rank without counting."""
    import threading

    from conftest import DEMO_TRAIN
    from orb.data.dataset import AseDbDataset
    from orb.models.config import ModelConfig

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    settings = ModelConfig.from_dict(dict(name="orb_v3_conservative_inf_omat")).graph_settings()
    serial = AseDbDataset(DEMO_TRAIN, settings=settings).count_edge_capacities(0, 64)

    def start(world: int):
        board, barrier, counted, results = {}, threading.Barrier(world), {}, {}

        def rank(r: int) -> None:
            dataset = AseDbDataset(DEMO_TRAIN, settings=settings)

            def count(a: int, b: int):
                counted[r] = (a, b)
                return dataset.count_edge_capacities(a, b)

            results[r] = (dataset.edge_capacities(count, _ThreadRanks(r, world, board, barrier)), dataset)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(results) == world
        return results, counted

    results, counted = start(3)
    assert sorted(counted.values()) == [(0, 21), (21, 42), (42, 64)]  # disjoint shares, all rows
    for capacities, dataset in results.values():
        np.testing.assert_array_equal(capacities, serial)
        assert dataset.capacities_read_from is None and dataset.capacities_kept_in
    results, counted = start(3)
    assert counted == {}
    for capacities, dataset in results.values():
        np.testing.assert_array_equal(capacities, serial)
        assert dataset.capacities_read_from == results[0][1].capacities_read_from is not None


def heights(cell):
    """A cell's heights (its volume over each face's area), 0 for a singular one."""
    cell = np.asarray(cell, np.float64)
    faces = np.linalg.norm(np.cross(cell[[1, 2, 0]], cell[[2, 0, 1]]), axis=1)
    return np.abs(np.linalg.det(cell)) / np.maximum(faces, 1e-300)


def test_supercell_offsets_hold_orb_models_and_every_image_within_the_radius():
    """orb-v3's image offsets, for cells from thin to skewed: orb-models' (every lattice point within the radius
    widened by one cell, from [-4, 4]^3) in the lexicographic order torch.unique(dim=0) gives them (edge order
    follows it), and every offset at which an atom can have a neighbour within the radius (any fractional distance
    in (-1, 1)^3, found exhaustively), which orb-models' miss for short or skewed lattice vectors."""
    from itertools import product

    from orb.data.graphs import minimal_supercell_offsets

    lattice = np.array(list(product(range(-4, 5), repeat=3)), np.float32)
    wide = np.array(list(product(range(-9, 10), repeat=3)), np.float64)
    rng = np.random.default_rng(7)
    beyond = 0
    for k in range(200):
        cell = np.zeros((3, 3), np.float32)
        while np.min(heights(cell)) < 1.2:  # (a thin cell by chance: redrawn, the thin ones are below)
            cell = ((np.eye(3) + rng.normal(0, 0.35, (3, 3))) * rng.uniform(1.5, 14, (3, 1))).astype(np.float32)
        if k % 4 == 0:  # a short vector (0.9 Å), or one skewed over another (a Niggli-unreduced basis)
            row = k // 4 % 3
            cell[row] *= 0.9 / np.linalg.norm(cell[row]) if k % 8 else 1.0
            cell[1] += 3 * cell[0] if k % 8 == 0 else 0.0
        near = lattice[np.linalg.norm(lattice @ cell, axis=1) <= 6.0 + 1e-4]
        widened = (near[:, None, :] + np.array(list(product((-1, 0, 1), repeat=3)), np.float32)).reshape(-1, 3)
        offsets = minimal_supercell_offsets(cell, 6.0)
        assert offsets.dtype == np.float32 and np.array_equal(offsets, np.unique(offsets, axis=0))
        have = {tuple(o) for o in offsets.astype(int)}
        assert {tuple(o) for o in np.unique(widened, axis=0).astype(int)} <= have
        fractions = rng.uniform(-1, 1, (60, 1, 3))
        within = (np.linalg.norm((wide[None] + fractions) @ cell.astype(np.float64), axis=2) <= 6.0).any(axis=0)
        needed = {tuple(n) for n in wide[within].astype(int)}
        assert needed <= have, (cell.tolist(), sorted(needed - have)[:3])
        beyond += len(needed - {tuple(o) for o in widened.astype(int)}) > 0
    assert beyond >= 10  # the short and skewed cells need offsets orb-models' search does not hold
    with pytest.raises(StructureError, match="needs more than 1,000,000 periodic images"):  # not a hang or the OOM
        minimal_supercell_offsets(np.diag([0.01, 0.01, 5.0]).astype(np.float32), 6.0)  # killer


def test_step_totals_are_the_ranks_parts_summed():
    """The vectorised plan gives, per step, the largest rank part's atoms, edges and structures exactly as
    summing each rank's part of each global batch (np.array_split: the first ranks take one more; a rank may
    take none), and each rank's steps hold its part, with the smallest bucket that holds every part."""
    from orb.data.plan import plan_steps, step_totals

    rng = np.random.default_rng(3)
    natoms = rng.integers(1, 200, 1003)
    edges = natoms * rng.integers(5, 30, 1003)
    buckets = [Bucket(2000, 40000, 9), Bucket(4000, 80000, 9), Bucket(20000, 400000, 9)]
    for batch, world in ((8, 1), (8, 3), (5, 4), (3, 5)):
        sampler = EpochSampler(len(natoms), batch, seed=5)
        for epoch in range(2):
            shards = sampler.shards(epoch, world)
            totals = step_totals(shards, natoms, edges)
            steps = [plan_steps(shards, natoms, edges, buckets, rank, epoch) for rank in range(world)]
            for s, global_batch in enumerate(sampler.global_batches(epoch)):
                parts = np.array_split(global_batch, world)
                assert totals.nodes[s] == max(natoms[p].sum() for p in parts)
                assert totals.edges[s] == max(edges[p].sum() for p in parts)
                assert totals.graphs[s] == max(len(p) for p in parts)
                expected = min((b for b in buckets if all(b.holds(natoms[p].sum(), edges[p].sum(), len(p))
                                                          for p in parts)), key=lambda b: b.num_edges)
                for rank in range(world):
                    assert steps[rank][s].indices == tuple(parts[rank]) and steps[rank][s].bucket == expected
                    assert steps[rank][s].global_count == len(global_batch)
            assert len(steps[0]) == len(sampler) and list(steps[0][3:]) == [steps[0][i] for i in range(3, len(sampler))]
            assert totals.real_edges == edges.sum()  # every structure once per epoch


def test_evaluation_steps_pack_every_structure_once_by_size():
    """Validation and prediction passes pack structures by size: each once, every rank part within the limit
    (a structure larger than it alone), padding near none whatever order the rows are stored in; the steps
    hold the same structures for any number of ranks (so do the validation metrics)."""
    from orb.data.plan import eval_limit, padding_ratio, step_totals
    from orb.data.samplers import PackedSampler

    rng = np.random.default_rng(4)
    sizes = np.clip(np.rint(np.exp(rng.normal(np.log(20), 0.86, 3000))), 1, 444).astype(np.int64)
    natoms = np.repeat(sizes, 11)[:3000]  # trajectories stored together, as MPtrj
    edges = 20 * natoms
    for world in (1, 2, 3):
        limit = eval_limit(natoms, edges, 8)
        shards = PackedSampler(natoms, edges, limit).shards(0, world)
        assert sorted(shards.order.tolist()) == list(range(len(natoms)))
        for s in range(len(shards)):
            for rank in range(world):
                part = shards.part(s, rank)
                assert len(part) == 1 or limit.holds(natoms[part].sum(), edges[part].sum(), len(part))
        single = PackedSampler(natoms, edges, limit).shards(0, 1)
        assert len(shards) == len(single) and all(
            sorted(shards.global_batch(s).tolist()) == sorted(single.global_batch(s).tolist()) for s in range(len(single)))
        totals = step_totals(shards, natoms, edges)
        buckets = plan_buckets(totals.nodes, totals.edges, limit.num_graphs,
                               (int(totals.nodes.max()), int(totals.edges.max())), 0, 10 * len(shards))
        assert not any(b.spare for b in buckets)  # planned on exactly the steps it runs
        # with several ranks a structure alone in its batch (larger than half the limit) leaves the others idle
        assert padding_ratio(totals, buckets, world)[1] <= (1.15 if world == 1 else 1.4)
