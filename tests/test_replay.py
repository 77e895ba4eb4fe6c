"""Fine-tuning that keeps the foundation: replay data mixed into every step, forgetting measured every epoch,
pseudo-labels, farthest-point selection, reference energies fitted to the user's DFT, per-structure
weights, early stopping and per-element errors."""

import json
import os

import ase.db
import numpy as np
import pytest
from ase.data import chemical_symbols

from conftest import DEMO_TRAIN, DEMO_VAL, ROOT, SMALL_MODEL, op_by_op

PRETRAIN_TRAIN = os.path.join(ROOT, "data", "pretrain", "pretrain_train.db")
PRETRAIN_VAL = os.path.join(ROOT, "data", "pretrain", "pretrain_val.db")
DEMO_CKPT = os.path.join(ROOT, "data", "demo_pretrained.ckpt")
DEMO_V3_CKPT = os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")
DEMO_ARCH = dict(latent_dim=128, mlp_hidden_dim=256, num_message_passing_steps=4, head_mlp_hidden_dim=128)
TIMING = ("train_time", "val_time", "compile_time", "data_wait")


def copy_rows(source, path, count=None, start=0, transform=None, **key_values):
    """The first ``count`` rows of ``source`` (from ``start``) into a new database, optionally changed."""
    with ase.db.connect(source) as src, ase.db.connect(path, append=False) as dst:
        for i, row in enumerate(list(src.select())[start:None if count is None else start + count]):
            atoms = row.toatoms()
            if transform is not None:
                atoms = transform(i, atoms)
            dst.write(atoms, **key_values)
    return str(path)


# ------------------------------------------------------------------ the data layer
def test_mixed_sampler_takes_every_target_once_per_epoch_and_a_fixed_replay_share():
    from orb.data.samplers import MixedSampler

    targets, replays, batch, per_step = 23, 10, 8, 3
    sampler = MixedSampler(targets, replays, batch, per_step, seed=5)
    assert len(sampler) == -(-targets // (batch - per_step))
    stream = []
    for epoch in range(4):
        batches = sampler.global_batches(epoch)
        assert len(batches) == len(sampler)
        seen = np.concatenate(batches)
        target = np.sort(seen[seen < targets])
        np.testing.assert_array_equal(target, np.arange(targets))  # one pass over the target per epoch
        for b in batches[:-1]:
            assert len(b) == batch and (b >= targets).sum() == per_step  # stratified: exact share in every step
        last = batches[-1]
        assert (last < targets).sum() == targets % (batch - per_step)
        assert (last >= targets).sum() == round((targets % (batch - per_step)) * per_step / (batch - per_step))
        stream += [int(i) - targets for b in batches for i in b if i >= targets]
        assert [b.tolist() for b in batches] == [b.tolist() for b in MixedSampler(
            targets, replays, batch, per_step, seed=5).global_batches(epoch)]  # a pure function of (seed, epoch)
    # the replay stream runs through every replay structure before repeating one, across epochs
    uses = np.bincount(stream, minlength=replays)
    assert uses.max() - uses.min() <= 1 and len(stream) == 4 * sampler.replay_per_epoch()
    assert sampler.global_batches(0)[0].tolist() != MixedSampler(targets, replays, batch, per_step, 6).global_batches(
        0)[0].tolist()


def test_mixture_maps_positions_to_sources_with_their_weights(tmp_path):
    from orb.data.dataset import AseDbDataset
    from orb.data.mixture import Mixture, Source

    weighted = copy_rows(DEMO_VAL, tmp_path / "w.db", 4, weight=2.5)
    target, replay = AseDbDataset(DEMO_TRAIN), AseDbDataset(weighted)
    mixture = Mixture([Source("train", target, [3, 1]), Source("replay", replay, [2, 0], loss_weight=0.5)])
    assert len(mixture) == 4 and mixture.names == ["train", "replay"]
    np.testing.assert_array_equal(mixture.natoms, np.concatenate([target.natoms[[3, 1]], replay.natoms[[2, 0]]]))
    np.testing.assert_array_equal(mixture.weights, [1, 1, 1.25, 1.25])
    np.testing.assert_array_equal(mixture.get(2).positions, replay.get(2).positions)
    assert mixture.get(2).weight[0] == pytest.approx(1.25) and mixture.get(0).weight[0] == 1
    assert mixture.row_id(3) == ["replay", int(replay.ids[0])]


def test_row_weights_are_read_and_checked(tmp_path):
    from orb.data.dataset import AseDbDataset
    from orb.errors import DatasetError

    path = str(tmp_path / "w.db")
    with ase.db.connect(DEMO_VAL) as src, ase.db.connect(path) as dst:
        rows = list(src.select())[:3]
        dst.write(rows[0].toatoms(), weight=3.0)
        dst.write(rows[1].toatoms())
        dst.write(rows[2].toatoms(), weight=0)
    np.testing.assert_array_equal(AseDbDataset(path).weights, [3.0, 1.0, 0.0])
    for bad, message in ((-1.0, "finite number >= 0"), ("heavy", "must be a number")):
        other = str(tmp_path / f"bad{bad}.db")
        with ase.db.connect(other) as dst:
            dst.write(rows[0].toatoms())
            dst.write(rows[1].toatoms(), weight=bad)
        with pytest.raises(DatasetError, match=rf"bad.*\.db, row 2, key 'weight': .*{message}"):
            AseDbDataset(other)


def test_farthest_point_sampling_follows_its_definition():
    from orb.data.selection import farthest_point_sampling, hold_out, random_sample

    rng = np.random.default_rng(0)
    points = rng.normal(size=(60, 5))
    chosen = farthest_point_sampling(points, 12, seed=3)
    assert len(set(chosen.tolist())) == 12
    for k in range(1, 12):  # each pick is the point farthest from all earlier picks
        dist = np.min(np.linalg.norm(points[:, None] - points[chosen[:k]][None], axis=2), axis=1)
        assert dist[chosen[k]] == pytest.approx(dist.max())
    np.testing.assert_array_equal(chosen, farthest_point_sampling(points, 12, seed=3))
    # two tight clusters and one far point: FPS takes the far point and both clusters first
    clustered = np.concatenate([rng.normal(0, 0.01, (30, 2)), rng.normal(5, 0.01, (30, 2)), [[50.0, 50.0]]])
    first = farthest_point_sampling(clustered, 3, seed=1)
    assert 60 in first and {(i < 30) for i in first if i != 60} == {True, False}
    kept, held = hold_out(20, 5, seed=2)
    assert len(held) == 5 and not set(kept) & set(held) and sorted(set(kept) | set(held)) == list(range(20))
    sample = random_sample(kept, 4, seed=2)
    assert set(sample) <= set(kept) and len(sample) == 4


# ------------------------------------------------------------------ reference energies
def test_reference_fit_recovers_per_element_shifts_and_keeps_what_data_cannot_separate(tmp_path):
    from orb.data.dataset import AseDbDataset
    from orb.models.reference_energies import vasp_shifted
    from orb.training.reference_fit import fit_reference_energies, reference_baseline

    data = AseDbDataset(DEMO_TRAIN)
    composition = data.composition()
    positions, numbers, counts = composition
    for i in range(len(data)):  # the species table agrees with the rows
        row = data.row(i)
        here = positions == i
        assert dict(zip(numbers[here].tolist(), counts[here].tolist())) == \
            {int(z): int((row.numbers == z).sum()) for z in set(row.numbers)}
    rng = np.random.default_rng(1)
    current = vasp_shifted()
    shift = np.zeros_like(current)
    shift[[13, 28, 29, 46, 47, 78, 79]] = rng.uniform(-1, 1, 7)  # Al Ni Cu Pd Ag Pt Au
    model = rng.normal(0, 5, len(data))  # any "model prediction"
    noise = rng.normal(0, 1e-3, len(data))
    energy = model + np.bincount(positions, shift[numbers] * counts, len(data)) + noise
    fit = fit_reference_energies("residual", composition, energy, model, current)
    np.testing.assert_allclose(fit.table - current, shift, atol=2e-3)  # every element's shift, nothing else
    assert fit.rank == len(fit.elements) == 7 and fit.rmse_after < 0.01 * fit.rmse_before
    assert fit.change["Cu"] == pytest.approx(shift[29], abs=2e-3)
    # least squares: the references alone explain the energies (exact for energies that are per-element sums)
    exact = np.bincount(positions, (current + shift)[numbers] * counts, len(data))
    table = fit_reference_energies("least_squares", composition, exact, reference_baseline(composition, len(data),
                                                                                             current), current).table
    np.testing.assert_allclose(table, current + shift, atol=1e-6)
    # one stoichiometry only (every structure Cu3Ni): only the sum 3 d_Cu + d_Ni is known; the smallest change keeps
    # the checkpoint's split (d proportional to (3, 1)), and the deficit is reported
    composition = (np.repeat(np.arange(10), 2), np.tile([29, 28], 10), np.tile([3, 1], 10))
    energy = np.full(10, 2.0)
    fit = fit_reference_energies("residual", composition, energy, np.zeros(10), current)
    assert fit.rank == 1 and len(fit.elements) == 2 and "cannot separate" in fit.summary()
    assert 3 * fit.change["Cu"] + fit.change["Ni"] == pytest.approx(2.0, rel=1e-6)
    assert fit.change["Cu"] == pytest.approx(3 * fit.change["Ni"], rel=1e-6)


def test_reference_fit_weighs_each_structure_by_its_loss_weight():
    """A structure of weight 0 (a label the user does not trust) moves nothing, not even an element only it holds,
    and weight 2 is the structure counted twice: the fit ignored the weights, so a weight-0 structure 50 eV off
    moved every element it held."""
    from orb.models.reference_energies import vasp_shifted
    from orb.training.reference_fit import fit_reference_energies

    rng = np.random.default_rng(3)
    current = vasp_shifted()
    structures = 30
    elements = np.array([13, 28, 29])  # Al Ni Cu, and Au (79) only in the last structure
    positions = np.repeat(np.arange(structures), 3)
    numbers = np.tile(elements, structures)
    counts = rng.integers(1, 6, 3 * structures)
    positions, numbers, counts = (np.append(positions, structures - 1), np.append(numbers, 79),
                                  np.append(counts, 2))
    energy = np.bincount(positions, np.array([0, 0.3, -0.2, 0.1] + [0] * 200)[np.searchsorted([13, 28, 29, 79],
                                                                                              numbers)] * counts,
                         structures) + rng.normal(0, 1e-2, structures)
    untrusted = energy.copy()
    untrusted[-1] += 50.0
    weights = np.ones(structures)
    weights[-1] = 0.0
    kept = fit_reference_energies("residual", (positions, numbers, counts), untrusted, np.zeros(structures), current,
                                  weights)
    here = positions < structures - 1
    without = fit_reference_energies("residual", (positions[here], numbers[here], counts[here]), energy[:-1],
                                     np.zeros(structures - 1), current)
    np.testing.assert_allclose(kept.table, without.table, rtol=0, atol=1e-9)
    assert kept.table[79] == current[79] and kept.structures == structures - 1
    twice = weights.copy()
    twice[0] = 2.0
    doubled = (np.concatenate([positions, np.full(3, structures)]), np.concatenate([numbers, numbers[:3]]),
               np.concatenate([counts, counts[:3]]))
    np.testing.assert_allclose(
        fit_reference_energies("residual", (positions, numbers, counts), untrusted, np.zeros(structures), current,
                               twice).table,
        fit_reference_energies("residual", doubled, np.append(untrusted, untrusted[0]), np.zeros(structures + 1),
                               current, np.append(weights, 1.0)).table, rtol=0, atol=1e-9)


# ------------------------------------------------------------------ weighted losses
@pytest.mark.parametrize("name", ["orb_v2", "orb_v3_direct_20_omat", "orb_v3_conservative_20_omat"])
def test_a_structure_counts_in_the_loss_by_its_weight(name):
    """Weights multiply each structure's contribution: a weight-0 structure's labels change nothing, scaling every
    weight scales the loss and its gradient, and a weight of 2 is the structure counted twice (orb-v2's
    per-structure average)."""
    import mindspore as ms

    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.tensors import loss_inputs
    from orb.models import create
    from orb.training.config import config_from_dict
    from orb.training.engine import make_loss

    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = config_from_dict(dict(model=dict(SMALL_MODEL, name=name), device_target="CPU"))
    model = create(name, seed=1, **SMALL_MODEL)
    cell = make_loss(model, cfg, has_stress=True)
    grad = ms.value_and_grad(cell, None, cell.trainable_params(), has_aux=True)
    data = AseDbDataset(DEMO_TRAIN, settings=cfg.model.graph_settings())
    graphs = [data[i] for i in range(3)]
    stats = cell.current_stats()

    def loss_and_grads(weights, graphs=graphs, count=3):
        batch = pad_batch(batch_graphs(graphs), 96, 1800 if name == "orb_v2" else 3000, len(graphs) + 1)
        weight = np.zeros(len(graphs) + 1, np.float32)
        weight[:len(graphs)] = np.asarray(weights, np.float32) / count
        (loss, _), grads = grad(*loss_inputs(batch, weight), *stats, *stats)
        return float(loss.asnumpy()), np.concatenate([g.asnumpy().ravel() for g in grads])

    base, base_grad = loss_and_grads([1, 0, 1])
    changed = [graphs[0], data[5], graphs[2]]  # another structure's labels (and atoms) in the weight-0 place
    changed[1].energy = changed[1].energy + 100.0
    other, other_grad = loss_and_grads([1, 0, 1], changed)
    if name == "orb_v2":  # orb-v3 averages forces over every atom of the batch: the atom count may differ
        assert other == base
        np.testing.assert_array_equal(other_grad, base_grad)
    relabelled = [graphs[0], graphs[1], graphs[2]]
    relabelled[1] = data[1]
    relabelled[1].energy = relabelled[1].energy + 100.0
    relabelled[1].forces = relabelled[1].forces + 5.0
    same, same_grad = loss_and_grads([1, 0, 1], relabelled)
    assert same == pytest.approx(base, rel=1e-6)
    np.testing.assert_allclose(same_grad, base_grad, rtol=1e-5, atol=1e-7 * np.abs(base_grad).max())
    assert loss_and_grads([1, 1, 1], relabelled)[0] > loss_and_grads([1, 1, 1])[0] + 0.01  # weight 1: labels count
    double, double_grad = loss_and_grads([2, 0, 2])
    assert double == pytest.approx(2 * base, rel=1e-6)
    np.testing.assert_allclose(double_grad, 2 * base_grad, rtol=1e-4, atol=1e-6 * np.abs(base_grad).max())
    if name == "orb_v2":
        twice = loss_and_grads([2, 1, 1])[0] * 3
        assert twice == pytest.approx(loss_and_grads([1, 1, 1, 1], graphs + [graphs[0]], count=4)[0] * 4, rel=1e-5)


# ------------------------------------------------------------------ the trainer with replay
def make_cfg(tmp_path, **overrides):
    from orb.training.config import config_from_dict

    values = dict(train_data_path=DEMO_TRAIN, val_data_path=DEMO_VAL, output_dir=str(tmp_path / "run"),
                  device_target="CPU", batch_size=4, max_epochs=2, lr=1e-3, lr_schedule="constant",
                  buckets=[[136, 2720]], progress_bar="false", log_every_n_steps=4, data_workers=0,
                  model=dict(SMALL_MODEL))
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = dict(values[key], **value)
        else:
            values[key] = value
    return config_from_dict(values)


def trainer_for(cfg, resume=None):
    from orb.device import configure_mindspore
    from orb.training.outputs import prepare_output_dir
    from orb.training.setup import build_trainer

    configure_mindspore(cfg.device_target, cfg.device_id, cfg.num_threads)
    prepare_output_dir(cfg.output_dir, resume=bool(resume), overwrite=False)
    return build_trainer(cfg, resume=resume)


def records(run_dir, kind=None):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in rows if kind is None or r["type"] == kind]


@pytest.fixture(scope="module")
def small_sets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replay_data")
    return {"train": copy_rows(DEMO_TRAIN, folder / "train.db", 10),
            "replay": copy_rows(PRETRAIN_TRAIN, folder / "replay.db", 24)}


def test_replay_is_in_every_step_validated_every_epoch_and_resumes_exactly(tmp_path, small_sets, caplog):
    """fraction 0.5 of a batch of 4: 2 target + 2 replay structures per step; 6 replay rows held out and validated;
    the run and a run stopped after one epoch and resumed end with identical weights and metrics."""
    replay = dict(data_path=small_sets["replay"], fraction=0.5, val_samples=6, selection="random", num_samples=12)
    cfg = dict(train_data_path=small_sets["train"], replay=replay, record_batches=True)
    caplog.set_level("INFO", logger="orb")
    straight = trainer_for(make_cfg(tmp_path / "a", **cfg))
    assert straight.data.steps_per_epoch == 5 and len(straight.data.replay_train) == 12 and len(straight.data.replay_val) == 6
    straight.fit()
    run = tmp_path / "a" / "run"
    initial = records(run, "initial")[0]
    assert {"val", "replay_val"} <= set(initial)
    epochs = records(run, "epoch")
    assert len(epochs) == 2 and all({"train", "val", "replay_val"} <= set(e) for e in epochs)
    assert set(epochs[-1]["val"]["forces_mae_by_element"]) <= {"Al", "Ni", "Cu", "Pd", "Ag", "Pt", "Au"}
    log = caplog.text
    assert "replay_val_metrics: {" in log and "replay_val against the starting model:" in log
    assert "each step: 2 target + 2 replay structures" in log
    steps = [json.loads(line) for line in open(run / "batches_rank0.jsonl")]
    held_out = set(int(i) for i in straight.data.replay_val.ids)
    trained_replay = set()
    for epoch in (1, 2):
        ids = [r["row_ids"] for r in steps if r["epoch"] == epoch]
        assert all(sum(isinstance(i, list) and i[0] == "replay" for i in s) == 2 for s in ids)
        target = sorted(i[1] for s in ids for i in s if i[0] == "train")
        assert target == sorted(int(i) for i in straight.data.train_source.ids)  # every target row once per epoch
        trained_replay |= {i[1] for s in ids for i in s if i[0] == "replay"}
    assert trained_replay <= set(int(i) for i in straight.data.replay_train.ids) and not trained_replay & held_out
    first = trainer_for(make_cfg(tmp_path / "b", **cfg))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b", **cfg), resume=str(tmp_path / "b" / "run"))
    assert resumed.progress.initial == first.progress.initial  # the starting point survives the resume (forgetting line)
    resumed.fit()
    for (name, a), (_, b) in zip(straight.model.parameters_and_names(), resumed.model.parameters_and_names()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=name)

    def clean(record):
        return {k: {m: v for m, v in record[k].items() if m not in TIMING} for k in ("train", "val", "replay_val")}

    assert clean(records(tmp_path / "b" / "run", "epoch")[-1]) == clean(epochs[-1])
    changed = make_cfg(tmp_path / "b", **dict(cfg, replay=dict(replay, fraction=0.25), max_epochs=3))
    from orb.errors import ConfigError

    with pytest.raises(ConfigError, match="replay.fraction: 0.5 -> 0.25"):
        trainer_for(changed, resume=str(tmp_path / "b" / "run"))


def test_pseudo_labels_are_the_starting_models_predictions_chosen_by_fps_and_cached(tmp_path, monkeypatch,
                                                                                     small_sets, caplog):
    """labels: model: every replay structure's labels are the starting checkpoint's predictions of the unrotated
    structure (so the starting model's replay_val error is 0); fps chooses what farthest-point sampling of its
    descriptors chooses; a second start reads both from the cache."""
    import logging

    from orb.data.batching import batch_graphs
    from orb.data.selection import farthest_point_sampling
    from orb.inference.predictor import Predictor
    from orb.models.cells import DescriptorCell

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    replay = dict(data_path=small_sets["replay"], fraction=0.5, val_samples=4, labels="model", num_samples=8,
                  selection="fps")
    cfg = make_cfg(tmp_path, train_data_path=small_sets["train"], checkpoint_path=DEMO_CKPT, model=DEMO_ARCH,
                   replay=replay, buckets=[])
    caplog.set_level(logging.INFO, logger="orb")
    trainer = trainer_for(cfg)
    data = trainer.data.databases["replay"]
    table = data.label_table
    used = np.union1d(trainer.data.replay_train.positions, trainer.data.replay_val.positions)
    np.testing.assert_array_equal(table.positions, used)
    predictor = Predictor(trainer.model)
    data.set_labels(None)
    for k, position in enumerate(used):
        graph = data.get(int(position))  # the database's own labels, unrotated
        out = predictor(batch_graphs([graph]))
        assert table.energy[k] == pytest.approx(out["energy"][0], abs=2e-5)
        np.testing.assert_allclose(table.forces[table.offsets[k]:table.offsets[k + 1]], out["forces"], atol=2e-5)
        np.testing.assert_allclose(table.stress[k], out["stress"][0], atol=2e-6)
        assert abs(out["energy"][0] - graph.energy[0]) > 1e-3  # not the DFT labels
    # farthest-point sampling over the descriptors of the candidates (the rows not held out)
    from orb.data.batching import pad_batch
    from orb.data.selection import hold_out
    from orb.data.tensors import model_inputs

    candidates, held = hold_out(len(data), 4, cfg.random_seed)
    np.testing.assert_array_equal(held, trainer.data.replay_val.positions)
    cell = DescriptorCell(trainer.model)
    descriptors = np.stack([cell(*model_inputs(pad_batch(batch_graphs([data.get(int(p))]), 40, 800, 2))).asnumpy()[0]
                            for p in candidates])
    data.set_labels(table)
    expected = np.sort(candidates[farthest_point_sampling(descriptors, 8, cfg.random_seed)])
    np.testing.assert_array_equal(trainer.data.replay_train.positions, expected)
    initial = trainer.validate_all()
    assert initial["replay_val"]["energy_mae"] < 1e-4 and initial["replay_val"]["forces_mae"] < 2e-5
    assert initial["val"]["energy_mae"] > 0.01
    caplog.clear()
    again = trainer_for(make_cfg(tmp_path / "again", **{k: getattr(cfg, k) for k in ()},
                                 train_data_path=small_sets["train"], checkpoint_path=DEMO_CKPT, model=DEMO_ARCH,
                                 replay=replay, buckets=[]))
    assert "chosen by farthest-point sampling, read from the cache" in caplog.text
    assert caplog.text.count("read from the cache") == 2 and "computed by the starting model" not in caplog.text
    np.testing.assert_array_equal(again.data.replay_train.positions, trainer.data.replay_train.positions)
    np.testing.assert_array_equal(again.data.databases["replay"].label_table.forces, table.forces)


def shifted_copy(source, path, shifts):
    """``source`` with each row's energy moved by ``shifts`` (eV per atom of each element), as another DFT code or
    functional would give (forces and stress unchanged)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    def shift(_, atoms):
        results = dict(atoms.calc.results)
        results["energy"] = results["energy"] + sum(shifts.get(s, 0.0) for s in atoms.get_chemical_symbols())
        atoms.calc = SinglePointCalculator(atoms, **results)
        return atoms

    return copy_rows(source, path, transform=shift)


def test_residual_fit_moves_the_frozen_orb_v3_references_to_another_dft_setup(tmp_path, caplog):
    """orb-v3 keeps its reference energies frozen: on energies shifted per element (+0.7 eV/atom Cu, -0.4 Ni), the
    starting model's energy error is large; fitted to the residuals before the first step, it is back near the
    unshifted error, the fitted change is exactly the shift (the fit is linear in the energies), and the table is
    what the model (and its checkpoints) then hold."""
    shifts = {"Cu": 0.7, "Ni": -0.4}
    train, val = shifted_copy(DEMO_TRAIN, tmp_path / "train.db", shifts), shifted_copy(DEMO_VAL, tmp_path / "val.db",
                                                                                      shifts)
    v3 = dict(DEMO_ARCH, name="orb_v3_conservative_20_omat")
    caplog.set_level("INFO", logger="orb")
    results, fits = {}, {}
    for name, (t, v, fit) in {"plain": (DEMO_TRAIN, DEMO_VAL, "none"), "plain_fit": (DEMO_TRAIN, DEMO_VAL, "residual"),
                              "shifted": (train, val, "none"), "shifted_fit": (train, val, "residual")}.items():
        cfg = make_cfg(tmp_path / name, train_data_path=t, val_data_path=v, checkpoint_path=DEMO_V3_CKPT, model=v3,
                       buckets=[], batch_size=8, reference_energies=dict(fit=fit))
        trainer = trainer_for(cfg)
        results[name] = trainer.validate_all()["val"]
        fits[name] = trainer.progress.reference_fit
        if fit != "none":
            table = trainer.model.reference_energy_weight().asnumpy()
            for symbol, value in fits[name]["table"].items():
                assert table[chemical_symbols.index(symbol)] == np.float32(value)
            assert trainer.checkpointer.meta(trainer.progress)["reference_energies_fit"] == fits[name]
    assert results["shifted"]["energy_mae"] > 2 * results["plain"]["energy_mae"]
    assert results["shifted_fit"]["energy_mae"] < 1.2 * results["plain"]["energy_mae"]
    assert results["shifted_fit"]["energy_mae"] == pytest.approx(results["plain_fit"]["energy_mae"], rel=1e-3)
    for symbol, value in shifts.items():
        assert fits["shifted_fit"]["change"][symbol] - fits["plain_fit"]["change"][symbol] == pytest.approx(value,
                                                                                                         abs=1e-5)
    assert set(fits["plain_fit"]["change"]) == {"Al", "Ni", "Cu", "Pd", "Ag", "Pt", "Au"}
    assert "reference energies fitted (residual) to 64 structures" in caplog.text


def test_early_stopping_ends_the_run_and_keeps_the_best(tmp_path, small_sets):
    """Training on energies 3 eV/atom off (validation on the true ones): the validation loss rises after the first
    epoch; with patience 1 the run stops after the first epoch without improvement, best_weights.ckpt holds the
    best epoch, and the rule matches the recorded losses."""
    from orb.io.checkpoint import load_checkpoint

    wrong = shifted_copy(small_sets["train"], tmp_path / "wrong.db", {s: 3.0 for s in
                                                                      ("Al", "Ni", "Cu", "Pd", "Ag", "Pt", "Au")})
    cfg = make_cfg(tmp_path, train_data_path=wrong, patience=1, max_epochs=6, lr=3e-3)
    trainer_for(cfg).fit()
    run = tmp_path / "run"
    losses = [r["val"]["loss"] for r in records(run, "epoch")]
    stopped = records(run, "stopped")
    best = int(np.argmin(losses)) + 1
    expected_stop = next((e for e in range(1, 7) if e - (int(np.argmin(losses[:e])) + 1) >= 1), None)
    assert stopped and len(losses) == expected_stop < 6  # it stopped, at the epoch the rule says
    assert stopped[0]["best_epoch"] == best and stopped[0]["best_val_loss"] == pytest.approx(min(losses))
    assert load_checkpoint(str(run / "checkpoints" / "best_weights.ckpt"))[2]["epoch"] == best
    trainer_for(cfg, resume=str(run / "checkpoints" / "last.ckpt")).fit()  # resumed: it stops there again, said once
    assert records(run, "stopped") == stopped  # (the resume appended a second line)


def test_bad_replay_input_stops_with_one_line_and_writes_nothing(tmp_path, small_sets):
    """Each mistake: one line naming the key, file or row, exit status 2, no output folder."""
    import subprocess
    import sys

    unlabelled = str(tmp_path / "unlabelled.db")
    with ase.db.connect(PRETRAIN_VAL) as src, ase.db.connect(unlabelled) as dst:
        for row in list(src.select())[:3]:
            atoms = row.toatoms()
            atoms.calc = None
            dst.write(atoms)
    empty = str(tmp_path / "empty.db")
    with ase.db.connect(empty) as db:
        db.write(next(ase.db.connect(PRETRAIN_VAL).select()).toatoms())
        db.delete([1])
    negative = copy_rows(small_sets["train"], tmp_path / "negative.db", weight=-1.0)
    no_energy = copy_rows(small_sets["train"], tmp_path / "no_energy.db", transform=lambda i, a: (
        setattr(a, "calc", None) if i == 3 else None) or a)
    cases = {
        "fraction": (["--replay.data_path", PRETRAIN_VAL, "--replay.fraction", "1.0"], r"'replay.fraction' must be in"),
        "missing": (["--replay.data_path", str(tmp_path / "nope.db")], r"nope.db: database file does not exist"),
        "empty": (["--replay.data_path", empty], r"empty.db: database has no rows"),
        "unlabelled": (["--replay.data_path", unlabelled, "--replay.fraction", "0.5"],
                       r"unlabelled.db, row 1, key 'energy': row has no label"),
        "separate": (["--replay.data_path", PRETRAIN_VAL, "--replay.head", "separate"], r"'replay.head'"),
        "weight": (["--train_data_path", negative], r"negative.db, row 1, key 'weight': weight must be a finite"),
        "fit": (["--train_data_path", no_energy, "--reference_energies.fit", "least_squares"],
                r"no_energy.db, row 4, key 'energy'"),
        "model labels": (["--replay.data_path", PRETRAIN_VAL, "--replay.labels", "model", "--checkpoint_path", ""],
                         r"'replay.labels'.*needs checkpoint_path"),
    }
    for name, (args, message) in cases.items():
        out = tmp_path / name.replace(" ", "_")
        result = subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config", "configs/demo.yaml",
                                 "--device_target", "CPU", "--output_dir", str(out), *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, (name, result.stderr)
        assert __import__("re").search(message, lines[0]), (name, lines[0])
        assert not out.exists(), name


# ------------------------------------------------------------------ separate replay heads
@pytest.mark.parametrize("name", ["orb_v2", "orb_v3_conservative_20_omat", "orb_v3_direct_omol"])  # each head kind
def test_replay_heads_start_as_copies_predict_their_rows_and_are_never_exported(name):
    """Replay heads: copies of the heads (same predictions for either head index); changed, they change only the
    structures whose head is 1; a training step on replay structures updates only the replay heads' normalisers;
    exported weights hold the model's own heads only and load into a model without replay heads. What is checked is
    which head and normaliser each structure reaches, not a compiled graph (the training tests run replay heads
    compiled), so it runs op by op (a conservative model's graph, a gradient of a gradient, compiles in 40 s)
    except for the OMol model, whose forces op by op differ in the last bit from one call to the next."""
    import mindspore as ms

    if name.endswith("_omol"):
        ms.set_context(mode=ms.GRAPH_MODE)
        check_replay_heads(name)
    else:
        with op_by_op():
            check_replay_heads(name)


def check_replay_heads(name):
    from mindspore import Tensor

    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.tensors import loss_inputs, model_inputs
    from orb.io.checkpoint import load_torch_state_dict, to_torch_state_dict
    from orb.models import create
    from orb.training.config import config_from_dict
    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant
    from orb.training.steps import TrainStep
    from orb.training.engine import make_loss

    cfg = config_from_dict(dict(model=dict(SMALL_MODEL, name=name), device_target="CPU"))
    data = AseDbDataset(DEMO_TRAIN, settings=cfg.model.graph_settings())
    graphs = [data[i] for i in range(4)]
    model = create(name, seed=3, **SMALL_MODEL)
    exported_before = to_torch_state_dict(model)
    model.add_replay_heads()

    def predict(heads):
        batch = batch_graphs(graphs)
        batch.head = np.asarray(heads)
        outputs = model.predictions(*model_inputs(pad_batch(batch, 80, batch.num_edges + 8, 5)))
        return [o.asnumpy() for o in outputs[:3]]

    own, replay = predict([0, 0, 0, 0]), predict([1, 1, 1, 1])
    for a, b in zip(own, replay):
        np.testing.assert_array_equal(a, b)  # exact copies
    for p in model.replay_heads.trainable_params():  # the replay heads move away from the model's own
        p.set_data(Tensor(p.asnumpy() * 1.5 + 0.01))
    mixed, changed = predict([0, 1, 0, 1]), predict([1, 1, 1, 1])
    atoms = [g.num_nodes for g in graphs]
    first = slice(0, atoms[0])  # atoms of structure 0 (head 0)
    np.testing.assert_array_equal(mixed[0][[0, 2]], own[0][[0, 2]])
    np.testing.assert_array_equal(mixed[1][first], own[1][first])
    assert not np.allclose(mixed[0][[1, 3]], own[0][[1, 3]]) and np.allclose(mixed[0][[1, 3]], changed[0][[1, 3]],
                                                                             rtol=1e-5)
    exported = to_torch_state_dict(model)
    assert set(exported) == set(exported_before) and not any("replay" in k for k in exported)
    load_torch_state_dict(create(name, seed=0, **SMALL_MODEL), exported)
    # a training step on replay structures only: only the replay heads' normalisers absorb them
    loss = make_loss(model, cfg, has_stress=True)
    assert len(loss.normalizers) == 2 * loss.replay_offset
    step = TrainStep(loss, FlatAdam(model.trainable_params(), constant(1e-3, 4)))
    before = [[t.asnumpy().copy() for t in n.stats()] for n in loss.normalizers]
    batch = batch_graphs(graphs)
    batch.head = np.ones(4, np.int64)
    step(*loss_inputs(pad_batch(batch, 80, batch.num_edges + 8, 5)))
    after = [[t.asnumpy() for t in n.stats()] for n in loss.normalizers]
    for k, (b, a) in enumerate(zip(before, after)):
        moved = not all(np.array_equal(x, y) for x, y in zip(b, a))
        assert moved == (k >= loss.replay_offset), k


def test_separate_heads_train_on_model_labels_from_zero_and_export_the_target_heads(tmp_path, small_sets):
    """head: separate with model labels: the replay heads start as the foundation's, so the replay loss starts at 0
    (MACE's pseudo-label replay); both sets of heads train; best_weights.ckpt holds only the target's heads (the
    calculator loads it); a resume continues exactly."""
    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import load_checkpoint

    replay = dict(data_path=small_sets["replay"], fraction=0.5, val_samples=4, labels="model", head="separate",
                  selection="random", num_samples=10)
    cfg = dict(train_data_path=small_sets["train"], checkpoint_path=DEMO_CKPT, model=DEMO_ARCH, replay=replay,
               buckets=[], max_epochs=2)
    straight = trainer_for(make_cfg(tmp_path / "a", **cfg))
    start = {n: p.asnumpy().copy() for n, p in straight.model.parameters_and_names()}
    straight.fit()
    run = tmp_path / "a" / "run"
    initial = records(run, "initial")[0]
    assert initial["replay_val"]["energy_mae"] < 1e-4 and initial["replay_val"]["forces_mae"] < 2e-5
    assert initial["val"]["energy_mae"] > 0.01
    now = {n: p.asnumpy() for n, p in straight.model.parameters_and_names()}
    for prefix in ("replay_heads.graph_head.mlp", "graph_head.mlp"):
        assert any(not np.array_equal(now[n], start[n]) for n in now if n.startswith(prefix)), prefix
    best, _, _ = load_checkpoint(str(run / "checkpoints" / "best_weights.ckpt"))
    last, _, _ = load_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    assert not any(k.startswith("replay_heads.") for k in best) and any(k.startswith("replay_heads.") for k in last)
    atoms = ase.db.connect(DEMO_VAL).get(1).toatoms()
    atoms.calc = ORBCalculator.from_checkpoint(str(run / "checkpoints" / "best_weights.ckpt"))
    assert np.isfinite(atoms.get_potential_energy())
    first = trainer_for(make_cfg(tmp_path / "b", **cfg))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b", **cfg), resume=str(tmp_path / "b" / "run"))
    resumed.fit()
    for (name, a), (_, b) in zip(straight.model.parameters_and_names(), resumed.model.parameters_and_names()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=name)


def test_pseudo_labels_of_one_model_are_never_read_back_for_another(tmp_path, monkeypatch, small_sets, caplog):
    """orb_v3_conservative_20_omat and _inf_omat share their weights (one checkpoint: equal digests) but not their
    graphs. A _20_ run then an _inf_ run each train on their own model's predictions; the cache was keyed by
    the weights alone and gave the _inf_ run the _20_ model's energies."""
    from orb.data.batching import batch_graphs
    from orb.inference.predictor import Predictor

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    replay = dict(data_path=small_sets["replay"], fraction=0.5, val_samples=4, labels="model", num_samples=8,
                  selection="random")
    caplog.set_level("INFO", logger="orb")
    labels = {}
    for name in ("orb_v3_conservative_20_omat", "orb_v3_conservative_inf_omat", "orb_v3_conservative_20_omat"):
        caplog.clear()
        trainer = trainer_for(make_cfg(tmp_path / name, train_data_path=small_sets["train"], replay=replay,
                                       checkpoint_path=DEMO_V3_CKPT, model=dict(DEMO_ARCH, name=name), buckets=[]))
        data = trainer.data.databases["replay"]
        table = data.label_table
        data.set_labels(None)
        own = Predictor(trainer.model)(batch_graphs([data.get(int(p)) for p in table.positions]))["energy"]
        np.testing.assert_allclose(table.energy, own, atol=2e-4)  # this model's predictions, not another's
        data.set_labels(table)
        trainer.data.loader.close()
        read_back = "pseudo-labels of 12 structures of" in caplog.text and "read from the cache" in caplog.text
        assert read_back == (name in labels), name  # computed for each model, read back for the same one
        labels.setdefault(name, table.energy)
    twenty, inf = labels.values()
    assert np.abs(twenty - inf).max() > 1e-2  # the two models' energies differ: a shared entry would show


def test_pseudo_labels_follow_the_reference_fit_and_a_resume_keeps_both(tmp_path, small_sets):
    """fit: residual with labels: model: the pseudo-labels are the starting model's after the fit (they were computed
    before it and kept the old energy zero, pulling against the fit), so the starting model's replay_val error is
    0; a resumed run starts from the same fit and labels, its checkpoints keep the fit's record (it vanished),
    and it ends where the uninterrupted run does."""
    from orb.io.checkpoint import load_checkpoint

    shifts = {"Cu": 0.7, "Ni": -0.4}
    train = shifted_copy(small_sets["train"], tmp_path / "train.db", shifts)
    val = shifted_copy(DEMO_VAL, tmp_path / "val.db", shifts)
    replay = dict(data_path=small_sets["replay"], fraction=0.5, val_samples=4, labels="model", num_samples=8,
                  selection="random")
    cfg = dict(train_data_path=train, val_data_path=val, checkpoint_path=DEMO_CKPT, model=DEMO_ARCH, replay=replay,
               buckets=[], reference_energies=dict(fit="residual"))
    straight = trainer_for(make_cfg(tmp_path / "a", **cfg))
    fit = straight.progress.reference_fit
    assert fit["change"]["Cu"] > 0.3 and fit["change"]["Ni"] < -0.2
    straight.fit()
    initial = records(tmp_path / "a" / "run", "initial")[0]
    assert initial["replay_val"]["energy_mae"] < 1e-4 and initial["replay_val"]["forces_mae"] < 2e-5
    first = trainer_for(make_cfg(tmp_path / "b", **cfg))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b", **cfg), resume=str(tmp_path / "b" / "run"))
    assert resumed.progress.reference_fit == fit
    np.testing.assert_array_equal(resumed.data.databases["replay"].label_table.energy,
                                  first.data.databases["replay"].label_table.energy)
    resumed.fit()
    for name in ("last.ckpt", "best_weights.ckpt", "epoch_0002.ckpt"):
        meta = load_checkpoint(str(tmp_path / "b" / "run" / "checkpoints" / name))[2]
        assert meta["reference_energies_fit"] == fit, name
    for (name, a), (_, b) in zip(straight.model.parameters_and_names(), resumed.model.parameters_and_names()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=name)
