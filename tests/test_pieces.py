"""Each piece of a training run built and tested alone, through its public seams: the run's position
(Progress), the Checkpointer's files and retention, the run's data plans for 1 and 4 ranks, the guards and the
reporter."""

import math
import os
import re
import signal

import numpy as np
import pytest

from conftest import DEMO_TRAIN, DEMO_VAL, SMALL_MODEL


def test_progress_round_trips_through_checkpoint_metadata():
    """Every field a resume restores comes back as it was: values, not only keys (the reference fit record and
    each rank's open-interval sums went missing or were shared)."""
    import json

    from orb.training.checkpointing import Progress

    rng = np.random.default_rng(0)
    mid = Progress(epochs_done=3, global_step=1234, best_val=0.123456789, best_epoch=2, step_in_epoch=17,
                   epoch_sums=rng.normal(size=9), interval_sums=rng.normal(size=(4, 9)), skipped=2,
                   nonfinite=np.array([1, 2, 3]),
                   initial={"val": {"loss": 0.5}}, reference_fit={"method": "residual", "table": {"Cu": -3.25}})
    back = Progress.from_meta(json.loads(json.dumps(mid.to_meta())))  # as a checkpoint stores it: JSON
    for name in ("epochs_done", "global_step", "best_val", "best_epoch", "step_in_epoch", "skipped", "initial",
                 "reference_fit"):
        assert getattr(back, name) == getattr(mid, name), name
    np.testing.assert_array_equal(back.epoch_sums, mid.epoch_sums)
    np.testing.assert_array_equal(back.interval_sums, mid.interval_sums)
    np.testing.assert_array_equal(back.nonfinite, mid.nonfinite)  # the open interval's skipped steps
    fresh = Progress.from_meta(Progress().to_meta())
    assert math.isinf(fresh.best_val) and fresh.step_in_epoch == 0 and fresh.epoch_sums is None
    assert "step_in_epoch" not in Progress(epochs_done=1).to_meta()  # an epoch-end save holds no partial sums
    assert mid.improved(0.1, 4) and (mid.best_val, mid.best_epoch) == (0.1, 4) and not mid.improved(0.2, 5)


def test_a_resume_names_each_setting_that_changes_only_its_rounding():
    """Precision, kernels, threads, determinism and the number of workers may change on resume (the schedule and
    data order stay), but the result is then the uninterrupted run's only to rounding: each change is named."""
    from orb.training.config import TrainConfig
    from orb.training.state import arithmetic_changes

    saved = TrainConfig().to_dict()
    meta = {"config": saved, "world_size": 2}
    assert arithmetic_changes(meta, saved, 2) == []
    changed = dict(saved, precision="bf16-mixed", deterministic=True, num_threads=1, ops_profile="portable",
                   num_buckets=saved["num_buckets"] + 1)  # (the padded shapes: the products' last bits)
    assert arithmetic_changes(meta, changed, 4) == [
        "precision: 'float32-high' -> 'bf16-mixed'", "deterministic: False -> True", "num_threads: 0 -> 1",
        "ops_profile: 'auto' -> 'portable'", f"num_buckets: {saved['num_buckets']} -> {saved['num_buckets'] + 1}",
        "workers: 2 -> 4"]
    assert arithmetic_changes({"config": {}}, saved, 8) == []  # a checkpoint that did not record them: defaults


def test_a_resume_refuses_another_loss_labelling_or_graph(tmp_path):
    """The loss weights, where the labels are read, the model's graph and radial basis and the patience change
    what the resumed steps optimise (they were accepted silently: a resume with energy_key E2 mixed two
    labellings in one epoch's metrics); each is named, and accepted only when asked."""
    from orb.errors import ConfigError
    from orb.training.config import TrainConfig, config_from_dict
    from orb.training.state import CHECKPOINT_FORMAT, check_resume

    saved = dict(TrainConfig().to_dict(), val_data_path="val.db")  # patience needs a validation set
    meta = {"format": CHECKPOINT_FORMAT, "config": saved, "train_rows": 64}
    changed = config_from_dict(dict(saved, loss_weights=dict(saved["loss_weights"], stress=0.0), energy_key="E2",
                                    patience=3, model=dict(saved["model"], radius=5.0, rbf_radius=7.0),
                                    reference_energies=dict(saved["reference_energies"], fit="least_squares"))).to_dict()
    expected = ("reference_energies.fit: 'none' -> 'least_squares'; loss_weights.stress: 1.0 -> 0.0; energy_key: '' -> "
                "'E2'; patience: 0 -> 3; model.radius: 10.0 -> 5.0; model.rbf_radius: 10.0 -> 7.0")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_resume(meta, changed, 64, "last.ckpt", False)
    assert "; ".join(check_resume(meta, changed, 64, "last.ckpt", True)) == expected
    assert check_resume(meta, saved, 64, "last.ckpt", False) == []
    # lr_multipliers: later entries win, so the same entries in another order give other rates (resumed silently)
    ordered = dict(saved, lr_multipliers={"layers:0": 0.5, "layers": 0.1})
    reordered = config_from_dict(dict(saved, lr_multipliers={"layers": 0.1, "layers:0": 0.5})).to_dict()
    assert check_resume(dict(meta, config=ordered), reordered, 64, "last.ckpt", True) == [
        "lr_multipliers: {'layers:0': 0.5, 'layers': 0.1} -> {'layers': 0.1, 'layers:0': 0.5}"]
    assert check_resume(dict(meta, config=ordered), ordered, 64, "last.ckpt", False) == []
    # all the run's data are ASE databases: the label keys read nothing (said at start-up), so no refusal for them
    unused = ("energy_key", "forces_key", "stress_key")
    relabelled = config_from_dict(dict(saved, energy_key="E2")).to_dict()
    assert check_resume(meta, relabelled, 64, "last.ckpt", False, unused=unused) == []
    from orb.data.formats import label_keys_apply

    extxyz = tmp_path / "frames.extxyz"
    extxyz.write_text("")
    assert not label_keys_apply([DEMO_TRAIN, [DEMO_VAL, DEMO_TRAIN], ""])
    assert label_keys_apply([DEMO_TRAIN, [DEMO_VAL, str(extxyz)]])


def test_each_rank_gets_its_own_interval_sums_back():
    from orb.training.checkpointing import Progress, this_ranks_interval_sums
    from orb.training.distributed import DataParallel

    sums = np.arange(12, dtype=np.float64).reshape(3, 4)
    progress = Progress(step_in_epoch=5, epoch_sums=np.zeros(4), interval_sums=sums)
    for rank in range(3):
        np.testing.assert_array_equal(this_ranks_interval_sums(progress, DataParallel(rank, 3)), sums[rank])
    # resumed on another number of ranks: rank 0 takes the total, the others nothing (the sum over ranks is equal)
    np.testing.assert_array_equal(this_ranks_interval_sums(progress, DataParallel(0, 2)), sums.sum(axis=0))
    np.testing.assert_array_equal(this_ranks_interval_sums(progress, DataParallel(1, 2)), np.zeros(4))
    assert this_ranks_interval_sums(Progress(), DataParallel()) is None


def test_checkpointer_writes_keeps_and_reads_its_files(tmp_path):
    """last.ckpt at every save, best and best_weights (evaluation weights, exported) when improved, epoch_XXXX.ckpt
    every save_every_x_epochs with the newest `keep` kept; what it writes reads back; NaN is never saved."""
    import mindspore as ms

    from orb.errors import DivergedError, SaveError
    from orb.models import create
    from orb.training.checkpointing import Checkpointer, Progress
    from orb.training.distributed import DataParallel

    ms.set_context(mode=ms.GRAPH_MODE)
    model = create("orb_v2", **SMALL_MODEL)
    folder = tmp_path / "checkpoints"
    checkpointer = Checkpointer(str(folder), DataParallel(), model, {"format": "test", "config": {}}, 2, 7, 2)
    state = [("optimizer.step", np.array(5))]
    swapped = []

    from contextlib import contextmanager

    @contextmanager
    def evaluation_weights():
        swapped.append(True)
        yield

    progress = Progress()
    for epoch, loss in zip(range(1, 8), (5.0, 4.0, 4.5, 3.0, 3.5, 3.6, 3.7)):
        progress.epochs_done = epoch
        progress.global_step = 10 * epoch
        checkpointer.save_epoch(progress, state, progress.improved(loss, epoch), {"epoch": epoch}, evaluation_weights)
    assert sorted(os.listdir(folder)) == ["best.ckpt", "best_weights.ckpt", "epoch_0006.ckpt", "epoch_0007.ckpt",
                                          "last.ckpt"]
    weights, optimizer, meta = checkpointer.read(str(folder / "last.ckpt"))
    assert meta["format"] == "test" and meta["epoch"] == 7 and meta["global_step"] == 70
    assert int(optimizer["step"]) == 5 and set(weights) == {n for n, _ in model.parameters_and_names()}
    assert checkpointer.read(str(folder / "best.ckpt"))[2]["best_epoch"] == 4
    assert checkpointer.read(str(folder / "best_weights.ckpt"))[2] == {"epoch": 4} and len(swapped) == 3
    before = (folder / "last.ckpt").read_bytes()
    with pytest.raises(DivergedError, match="optimizer.moment1.x holds NaN or inf after global step 70: not saved"):
        checkpointer.save_last(progress, [("optimizer.moment1.x", np.array([np.nan]))])
    assert (folder / "last.ckpt").read_bytes() == before
    # last.ckpt is written after the best files: when one of those fails (a full disk; here a folder in the way),
    # last.ckpt still records the previous best, so a resume redoes the epoch and writes them again
    os.remove(folder / "best.ckpt")
    os.mkdir(folder / "best.ckpt")
    progress.epochs_done, progress.global_step = 8, 80
    with pytest.raises(SaveError, match="could not write .*best.ckpt"):
        checkpointer.save_epoch(progress, state, progress.improved(1.0, 8), {"epoch": 8}, evaluation_weights)
    assert (folder / "last.ckpt").read_bytes() == before
    assert checkpointer.read(str(folder / "last.ckpt"))[2]["best_epoch"] == 4


class ThreadRanks:
    """Ranks as threads of one process: an all-reduce that sums what every thread passes (what a DataParallel's
    ``all_reduce`` does across msrun's workers)."""

    def __init__(self, world: int):
        import threading

        self.world, self.barrier, self.values = world, threading.Barrier(world, timeout=60), {}

    def all_reduce(self, rank: int):
        def reduce(tensor):
            from mindspore import Tensor

            self.values[rank] = tensor.asnumpy()
            self.barrier.wait()
            total = sum(self.values[r] for r in range(self.world))
            self.barrier.wait()
            return Tensor(total)

        return reduce


def on_thread_ranks(world: int, work):
    """``work(DataParallel of rank r)`` on ``world`` ranks as threads, their all-reduce adding the ranks' float32 values
    one after another (a ring's order); each rank's result."""
    import threading

    from orb.training.distributed import DataParallel

    ranks, results = ThreadRanks(world), {}

    def run(rank):
        results[rank] = work(DataParallel(rank, world, all_reduce=ranks.all_reduce(rank)))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [results[rank] for rank in range(world)]


def test_sums_over_ranks_are_float64_sums_whatever_the_number_of_ranks():
    """A float32 all-reduce adds the ranks' values in float32: 8 ranks' equal sums of chosen row positions (7.5e9,
    the replay's check that every rank chose the same rows) came back 4,096 off, and metric totals to float32's 7
    digits. The sum over ranks is now the float64 sum in rank order, the same bits on every rank; shares (each element
    from one rank: a rank's rows) stay one all-reduce, exact."""
    world = 8
    positions = np.array([7_472_331_419.0])
    metrics = np.random.default_rng(0).uniform(0.0, 1e4, (world, 5))  # each rank's own interval sums
    shares = np.zeros((world, world * 3))
    for rank in range(world):
        shares[rank, rank * 3:rank * 3 + 3] = np.random.default_rng(rank).uniform(-1e9, 1e9, 3)

    def work(dp):
        return dp.sum(positions), dp.sum(metrics[dp.rank]), dp.sum_shares(shares[dp.rank])

    expected_metrics = np.zeros(5)
    for row in metrics:  # float64, rank order
        expected_metrics += row
    for summed, metric, share in on_thread_ranks(world, work):
        assert summed[0] == world * positions[0]
        np.testing.assert_array_equal(metric, expected_metrics)
        np.testing.assert_array_equal(share, shares.sum(axis=0))


def test_shares_travel_in_as_few_float32_parts_as_every_ranks_values_need_and_in_chunks():
    """Shares of float32 values (a float32 model's pseudo-labels and descriptors, counts) travel as one float32 part,
    float64 ones as three, exact either way, in all-reduces of at most ``chunk`` values: three parts of every
    value in one message made a replay's 1.5 M descriptors a 4.6 GB all-reduce per rank."""
    world, size = 3, 10
    rng = np.random.default_rng(1)
    single = np.zeros((world, size))
    double = np.zeros((world, size))
    for rank in range(world):
        single[rank, rank::world] = rng.standard_normal(len(range(rank, size, world))).astype(np.float32)
        double[rank, rank::world] = rng.standard_normal(len(range(rank, size, world)))
    sizes = {}

    def work(dp):
        reduce = dp.all_reduce
        seen = sizes.setdefault(dp.rank, [])
        dp.all_reduce = lambda tensor: (seen.append(tensor.shape), reduce(tensor))[1]
        return dp.sum_shares(single[dp.rank], chunk=4), dp.sum_shares(double[dp.rank], chunk=4)

    for got_single, got_double in on_thread_ranks(world, work):
        np.testing.assert_array_equal(got_single, single.sum(axis=0))
        np.testing.assert_array_equal(got_double, double.sum(axis=0))
    # each: a vote on the parts (3 values), then the parts in chunks of at most 4 values
    assert sizes[0] == [(3,), (4,), (4,), (2,)] + [(3,)] + [(4,), (4,), (2,)] * 3, sizes[0]


def test_every_rank_leaves_a_save_only_once_rank_0_has_written_it(tmp_path):
    """msrun SIGKILLs the other workers as soon as one exits non-zero: a rank that left a stop's save at once and
    exited 75 killed rank 0 in the middle of writing it (a full-size checkpoint on a shared file system takes
    seconds). Every rank now returns from a save once the file is written, and hears of rank 0's failure."""
    import threading
    import time

    import mindspore as ms

    from orb.errors import ClusterError, DivergedError
    from orb.io.checkpoint import load_checkpoint
    from orb.models import create
    from orb.training.checkpointing import Checkpointer, Progress
    from orb.training.distributed import DataParallel

    ms.set_context(mode=ms.GRAPH_MODE)
    model = create("orb_v2", **SMALL_MODEL)
    ranks = ThreadRanks(2)
    folder = tmp_path / "checkpoints"
    os.makedirs(folder)
    checkpointers = [Checkpointer(str(folder), DataParallel(rank, 2, all_reduce=ranks.all_reduce(rank)), model,
                                  {"format": "test", "config": {}}, 1, 3, 1) for rank in range(2)]
    progress = Progress(epochs_done=1, global_step=10)
    seen = {}

    def rank_1(state):
        try:
            checkpointers[1].save_last(progress, state)
            seen["file when rank 1 returned"] = os.path.exists(folder / "last.ckpt")
        except Exception as exc:
            seen["rank 1 raised"] = exc

    thread = threading.Thread(target=rank_1, args=([("optimizer.step", np.array(5))],))
    thread.start()
    time.sleep(1.0)  # rank 0 comes to the save later (it gathers and writes; rank 1 has nothing to write)
    checkpointers[0].save_last(progress, [("optimizer.step", np.array(5))])
    thread.join()
    assert seen == {"file when rank 1 returned": True}
    assert load_checkpoint(str(folder / "last.ckpt"))[2]["global_step"] == 10
    # rank 0 refuses to save NaN: it raises, and rank 1 hears of it instead of training on alone
    os.remove(folder / "last.ckpt")
    thread = threading.Thread(target=rank_1, args=([("optimizer.step", np.array(5))],))
    thread.start()
    with pytest.raises(DivergedError):
        checkpointers[0].save_last(progress, [("optimizer.m", np.array([np.nan]))])
    thread.join()
    assert isinstance(seen.get("rank 1 raised"), ClusterError) and "rank 0 could not write" in str(seen["rank 1 raised"])
    assert not os.path.exists(folder / "last.ckpt")


def test_a_bad_row_one_rank_finds_makes_every_rank_exit_as_for_bad_input(tmp_path, monkeypatch):
    """Rank 1 finds a bad row while checking the rows; rank 0 stops at the same collective with bad input of its
    own kind (exit status 2 on every rank): it was a fault (exit 1), so when msrun ended rank 1 before it said why,
    the job's status said fault."""
    import threading

    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    from orb.data.dataset import AseDbDataset
    from orb.errors import ClusterError, DatasetError, OrbInputError

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    bad = str(tmp_path / "bad_row.db")
    with ase.db.connect(DEMO_VAL) as src, ase.db.connect(bad) as dst:
        rows = list(src.select())
        for i, row in enumerate(rows):
            atoms = row.toatoms()
            if i == len(rows) - 1:  # in rank 1's half: a singular cell
                atoms.set_cell([atoms.cell[0], atoms.cell[1], atoms.cell[0]])
                atoms.calc = SinglePointCalculator(atoms, energy=row.energy, forces=row.forces, stress=row.stress)
            dst.write(atoms)
    barrier, values = threading.Barrier(2, timeout=60), {}

    class Rank:
        world_size = 2

        def __init__(self, rank):
            self.rank = rank

        def sum(self, array):
            values[self.rank] = np.asarray(array, np.float64)
            barrier.wait()
            total = values[0] + values[1]
            barrier.wait()
            return total

        sum_shares = sum

    raised = {}

    def check(rank):
        try:
            AseDbDataset(bad).census(ranks=Rank(rank))
        except Exception as exc:
            raised[rank] = exc

    threads = [threading.Thread(target=check, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isinstance(raised[1], DatasetError) and f"row {len(rows)}" in str(raised[1])
    assert isinstance(raised[0], OrbInputError) and not isinstance(raised[0], ClusterError)
    assert "another rank found bad input (a bad row or a damaged file) while checking the rows" in str(raised[0])


@pytest.fixture(scope="module")
def demo_databases():
    from orb.data.dataset import AseDbDataset

    return {"train": AseDbDataset(DEMO_TRAIN), "val": AseDbDataset(DEMO_VAL)}


@pytest.mark.parametrize("world", [1, 4])
def test_run_data_plans_every_row_once_per_epoch_on_every_rank(demo_databases, world):
    """Built alone for each rank of 1 and 4: every training row once per epoch over all ranks, the same number of
    steps and the same bucket at every step on every rank, the same global batches whatever the ranks, and
    every validation row once."""
    from orb.data.loader import BatchLoader
    from orb.training.config import config_from_dict
    from orb.training.distributed import DataParallel
    from orb.training.run_data import RunData

    cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, val_data_path=DEMO_VAL, batch_size=8, max_epochs=3,
                                device_target="CPU", data_workers=0, model=dict(SMALL_MODEL)))
    plans = []
    for rank in range(world):
        data = RunData(cfg, DataParallel(rank, world), demo_databases, BatchLoader(demo_databases), True)
        data.plan(None, None)
        plans.append(data)
    single = RunData(cfg, DataParallel(), demo_databases, BatchLoader(demo_databases), True)
    single.plan(None, None)
    for epoch in range(3):
        steps = [p.train_steps(epoch) for p in plans]
        assert len({len(s) for s in steps}) == 1 and len(steps[0]) == single.steps_per_epoch == 8
        for k in range(len(steps[0])):
            assert len({s[k].bucket for s in steps}) == 1  # every rank pads step k alike
            together = sorted(i for s in steps for i in s[k].indices)
            assert together == sorted(single.train_steps(epoch)[k].indices)  # the same global batch
        rows = sorted(i for s in steps for step in s for i in step.indices)
        assert rows == list(range(64))
    val = [p.eval_steps("val") for p in plans]
    assert sorted(i for s in val for step in s for i in step.indices) == list(range(16))
    assert len({len(s) for s in val}) == 1


def test_guards_flag_a_stop_and_name_the_rows_of_non_finite_steps():
    from orb.errors import DivergedError
    from orb.signals import StopSignals
    from orb.training.guards import Guards

    signals = StopSignals()
    guards = Guards(save_every_minutes=0, max_nonfinite_steps=3, log_every_n_steps=4, is_main=True, signals=signals)
    assert guards.flags().tolist() == [0.0, 0.0]
    with signals.deferred():
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guards.flags().tolist() == [1.0, 0.0] and signals.received == "SIGUSR1"
    for step in range(1, 6):
        guards.stepped(0, step, step, (2 * step, 2 * step + 1))
    rows = lambda indices: [100 + i for i in indices]  # noqa: E731
    assert guards.check_finite(np.array([0, 0, 0, 0]), rows) == 0
    assert guards.check_finite(np.array([1, 2, 4, 2]), rows) == 2  # a warning, not a stop
    with pytest.raises(DivergedError, match=r"3 training steps in a row .* epoch 1, step 5 \(global step 5\), rows "
                                            r"\[110, 111\]"):
        guards.check_finite(np.array([3, 3, 5, 3]), rows)
    stop = guards.stop("epoch 1, step 5 of 8", 5, "/x/last.ckpt")
    assert str(stop).startswith("stopped by SIGUSR1 at epoch 1, step 5 of 8 (global step 5); state saved in "
                                "/x/last.ckpt: continue with --resume auto (exit status 75)")


def test_reporter_writes_records_on_rank_0_and_forgets_those_after_a_checkpoint(tmp_path):
    import json

    from orb.training.reporting import Reporter

    main, other = Reporter(str(tmp_path), 0, "false", record_batches=True), Reporter(str(tmp_path), 1, "false", True)
    for step in (4, 8, 12):
        for reporter in (main, other):
            reporter.record({"type": "step", "step": step})
            reporter.batch(1, step, [step])
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [4, 8, 12]  # rank 1 wrote none
    assert os.path.exists(tmp_path / "batches_rank1.jsonl")
    main.forget_after(8)
    other.forget_after(8)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [4, 8]
    assert [json.loads(line)["step"] for line in open(tmp_path / "batches_rank1.jsonl")] == [4, 8]


def test_a_full_disk_under_a_record_is_one_line_for_every_record(tmp_path, monkeypatch):
    """metrics.jsonl's lines said a full disk in one line; record_batches' file was a traceback (and the run's data
    workers then kept the process from ending)."""
    import errno

    from orb.errors import SaveError
    from orb.training import reporting

    def full(path, record):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(reporting, "append_record", full)
    reporter = reporting.Reporter(str(tmp_path), 0, "false", record_batches=True)
    for write in (lambda: reporter.record({"type": "step", "step": 4}), lambda: reporter.batch(1, 4, [1, 2])):
        with pytest.raises(SaveError, match=r"could not append to .*(metrics|batches_rank0).jsonl \(No space left"):
            write()


def small_batch(rows, bucket):
    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch

    data = AseDbDataset(DEMO_TRAIN)
    return pad_batch(batch_graphs([data.get(i) for i in rows]), bucket.num_nodes, bucket.num_edges,
                     bucket.num_graphs)


def test_engine_alone_trains_gives_out_its_state_and_takes_it_back():
    """An Engine built on a model (no data, no files): a step changes the weights; another Engine given that
    state (weights, moments, EMA, step) continues bit for bit as the first one does."""
    import mindspore as ms

    from orb.data.buckets import Bucket
    from orb.data.tensors import loss_arrays
    from orb.models import create
    from orb.training.config import config_from_dict
    from orb.training.distributed import DataParallel
    from orb.training.engine import Engine

    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, device_target="CPU", model=dict(SMALL_MODEL),
                                lr_schedule="constant"))
    bucket = Bucket(64, 1280, 5)
    first, second = (small_batch(rows, bucket) for rows in ((0, 1, 2, 3), (4, 5, 6, 7)))
    a = Engine(create("orb_v2", seed=1, **SMALL_MODEL), cfg, DataParallel(), True, 10)
    before = {n: p.asnumpy().copy() for n, p in a.model.parameters_and_names()}
    a.train(loss_arrays(first), bucket)
    assert any(not np.array_equal(p.asnumpy(), before[n]) for n, p in a.model.parameters_and_names())
    entries = a.optimizer_entries()
    b = Engine(create("orb_v2", seed=2, **SMALL_MODEL), cfg, DataParallel(), True, 10)
    b.load({n: p.asnumpy() for n, p in a.model.parameters_and_names()},
           {k[len("optimizer."):]: v for k, v in entries}, "engine a")
    for (key, x), (_, y) in zip(entries, b.optimizer_entries()):
        np.testing.assert_array_equal(x, y, err_msg=key)
    a.take_interval_sums()  # the first step's metric sums: b holds none
    for engine in (a, b):
        engine.train(loss_arrays(second), bucket)
    for (name, x), (_, y) in zip(a.model.parameters_and_names(), b.model.parameters_and_names()):
        np.testing.assert_array_equal(x.asnumpy(), y.asnumpy(), err_msg=name)
    np.testing.assert_array_equal(a.take_interval_sums(), b.take_interval_sums())


def test_model_pass_alone_fills_every_structure_in_the_sources_order():
    """ModelPass over batches given in any order (here reversed, several per source) returns each structure's
    labels where the source has it: equal to one prediction of all of them together."""
    from types import SimpleNamespace

    import mindspore as ms

    from orb.data.buckets import Bucket
    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs
    from orb.data.mixture import Source
    from orb.data.tensors import loss_arrays
    from orb.inference.predictor import Predictor
    from orb.models import create
    from orb.training.distributed import DataParallel
    from orb.training.engine import Compiled, ModelPass

    ms.set_context(mode=ms.GRAPH_MODE)
    model = create("orb_v2", seed=3, **SMALL_MODEL)
    model.set_train(False)
    data = AseDbDataset(DEMO_TRAIN)
    source = Source("some rows", data, [9, 2, 30, 4, 17, 5])
    bucket = Bucket(80, 1600, 5)

    def batches(src):
        for indices in ([4, 5], [0, 1, 2], [3]):
            rows = [int(src.positions[i]) for i in indices]
            yield SimpleNamespace(bucket=bucket, indices=indices), loss_arrays(small_batch(rows, bucket))

    out = ModelPass(model, batches, DataParallel(), Compiled()).labels(source)
    expected = Predictor(model)(batch_graphs([data.get(int(p)) for p in source.positions]))
    np.testing.assert_allclose(out["energy"], expected["energy"], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(out["forces"], expected["forces"], atol=1e-5)
    np.testing.assert_allclose(out["stress"], expected["stress"], atol=1e-6)


class KnownOutputs:
    """A starting model whose outputs are known: each structure's descriptor is its row id on a line, its
    energy 100 + row id, forces 0.5, stress 0.25; calls are counted."""

    def __init__(self, dataset):
        self.dataset, self.calls = dataset, []

    def descriptors(self, source):
        self.calls.append(("descriptors", len(source)))
        ids = self.dataset.ids[source.positions].astype(np.float64)
        return {"descriptors": np.stack([ids, np.zeros_like(ids)], 1)}

    def labels(self, source):
        self.calls.append(("labels", len(source), source.head))
        atoms = int(self.dataset.natoms[source.positions].sum())
        return {"energy": 100.0 + self.dataset.ids[source.positions], "forces": np.full((atoms, 3), 0.5),
                "stress": np.full((len(source), 6), 0.25)}


@pytest.mark.parametrize("head", ["shared", "separate"])
def test_replay_choice_alone_selects_spread_rows_and_labels_them_once(tmp_path, monkeypatch, head):
    """replay.choose with a known starting model (no network, no trainer): farthest-point sampling spreads the
    chosen rows over the descriptor line; held-out rows are never chosen; every chosen and held-out row
    carries the model's labels, predicted by the heads that will predict it; a second choice with the same
    model reads both from the cache, another model's identity computes them again."""
    from orb.data.dataset import AseDbDataset
    from orb.data.row_results import ONE_PROCESS
    from orb.training import replay
    from orb.training.config import config_from_dict

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, checkpoint_path="x.ckpt", model=dict(SMALL_MODEL),
                                replay=dict(data_path=DEMO_TRAIN, fraction=0.25, num_samples=8, val_samples=6,
                                            labels="model", head=head)))

    def choose(key):
        data = AseDbDataset(DEMO_TRAIN)
        outputs = KnownOutputs(data)
        train, val = replay.choose(cfg, {"replay": data}, outputs, lambda: key, True, ONE_PROCESS)
        return data, outputs, train, val

    data, outputs, train, val = choose(("model", 1))
    ids = sorted(int(data.ids[p]) for p in train.positions)
    assert len(ids) == 8 and not set(train.positions) & set(val.positions) and len(val) == 6
    assert min(np.diff(ids)) >= 3 and ids[0] <= 4 and ids[-1] >= 60  # spread over 64 rows, ends included
    expected_head = 1 if head == "separate" else 0
    assert train.head == val.head == expected_head
    assert outputs.calls == [("descriptors", 58), ("labels", 14, expected_head)]
    for position in list(train.positions) + list(val.positions):
        graph = data.get(int(position))
        assert float(graph.energy[0]) == 100.0 + data.ids[position] and np.all(graph.forces == 0.5)
    again, outputs_again, train_again, _ = choose(("model", 1))
    assert outputs_again.calls == [] and np.array_equal(train_again.positions, train.positions)
    assert float(again.get(int(train.positions[0])).energy[0]) == 100.0 + data.ids[train.positions[0]]
    _, other, _, _ = choose(("model", 2))
    assert [c[0] for c in other.calls] == ["descriptors", "labels"]


def test_the_best_epoch_can_weigh_the_drift_from_the_foundation():
    """replay.in_selection: the loss that picks the best epoch adds the held-out replay structures' (against
    pseudo-labels: the drift from the foundation); refused without held-out replay structures."""
    from orb.errors import ConfigError
    from orb.training.config import config_from_dict
    from orb.training.trainer import selection_loss

    results = {"val": {"loss": 0.5}, "replay_val": {"loss": 0.25}}
    assert selection_loss(results, 9.0, False) == 0.5 and selection_loss(results, 9.0, True) == 0.75
    assert selection_loss({}, 9.0, True) == 9.0  # no validation set: the training loss
    replay = dict(data_path=DEMO_TRAIN, fraction=0.25, labels="model", val_samples=0, in_selection=True)
    with pytest.raises(ConfigError, match="'replay.in_selection' .* hold some out"):
        config_from_dict(dict(train_data_path=DEMO_TRAIN, checkpoint_path="x.ckpt", replay=replay))


@pytest.mark.parametrize("precision", ["float32-high", "fp16-mixed"])  # fp16: the loss-scaled gradient's own cell
def test_a_dropped_engine_or_calculator_gives_its_model_back(precision):
    """A trained-and-evaluated Engine, and a calculator that computed, are freed with their models once dropped: in
    MindSpore 2.10 a compiled ``construct(self, *inputs)`` calling a cell with ``*inputs`` kept that cell alive for
    the rest of the process (a notebook or workflow building one calculator per structure, or a test process
    building one trainer per test, grew by the model's weights and graphs each time: 110 MB per full-size orb-v2
    calculator)."""
    import gc
    import weakref

    import ase.db
    import mindspore as ms

    from orb.data.buckets import Bucket
    from orb.data.tensors import loss_arrays
    from orb.inference.calculator import ORBCalculator
    from orb.models import create
    from orb.precision import in_force
    from orb.training.config import config_from_dict
    from orb.training.distributed import DataParallel
    from orb.training.engine import Engine

    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, device_target="CPU", model=dict(SMALL_MODEL),
                                lr_schedule="constant", precision=precision))
    bucket = Bucket(64, 1280, 5)

    def used_and_dropped():
        with in_force(precision):
            engine = Engine(create("orb_v2", seed=1, **SMALL_MODEL), cfg, DataParallel(), True, 10)
            arrays = loss_arrays(small_batch((0, 1, 2, 3), bucket))
            engine.train(arrays, bucket)
            if precision == "fp16-mixed":  # (evaluation and inference do not depend on the loss scale)
                return [weakref.ref(engine.model)]
            assert np.isfinite(engine.evaluate(arrays, bucket)).all()
        calculator = ORBCalculator(create("orb_v2", seed=2, **SMALL_MODEL))
        atoms = ase.db.connect(DEMO_VAL).get(1).toatoms()
        atoms.calc = calculator
        assert np.isfinite(atoms.get_potential_energy())
        return [weakref.ref(engine.model), weakref.ref(calculator.model)]

    models = used_and_dropped()
    gc.collect()
    assert all(model() is None for model in models)


def test_settings_that_no_share_of_two_workers_can_meet_are_refused(demo_databases, tmp_path):
    """Checked on each rank alike (the 2-worker job that stops every rank with one such line: test_parallel): a
    validation set of fewer structures than workers, and buckets that cannot hold a rank's share of the batch."""
    import ase.db

    from orb.data.loader import BatchLoader
    from orb.errors import ConfigError
    from orb.training.config import config_from_dict
    from orb.training.distributed import DataParallel
    from orb.training.run_data import RunData, open_databases

    one_row = str(tmp_path / "one.db")
    with ase.db.connect(DEMO_VAL) as src, ase.db.connect(one_row) as dst:
        dst.write(next(src.select()).toatoms())
    two_equal_ranks = lambda tensor: tensor * 2  # noqa: E731  (both ranks read the same: every sum doubles)
    for rank in (0, 1):
        dp = DataParallel(rank, 2, all_reduce=two_equal_ranks)
        cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, val_data_path=one_row, batch_size=4,
                                    device_target="CPU", data_workers=0, model=dict(SMALL_MODEL)))
        with pytest.raises(ConfigError, match="one.db has 1 structure\\(s\\), fewer than the 2 workers$"):
            open_databases(cfg, dp)
        cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, val_data_path=DEMO_VAL, batch_size=4,
                                    buckets=[[16, 100]], device_target="CPU", data_workers=0,
                                    model=dict(SMALL_MODEL)))
        with pytest.raises(ConfigError, match="the largest bucket \\[16, 100\\] cannot hold a batch of the 2 "
                                              "largest"):
            RunData(cfg, dp, demo_databases, BatchLoader(demo_databases), True).plan(None, None)


def test_the_weights_digest_is_the_same_in_float64_and_float32():
    """A float64 model holding a float32 checkpoint's weights has the float32 model's digest (a resume that changed
    precision between float64 and float32 was refused: "its weights differ from those the run started from");
    a value float32 cannot hold still changes it."""
    import mindspore as ms
    from mindspore import Tensor

    from orb.models import create, to_float64, weights_digest

    small = dict(latent_dim=16, mlp_hidden_dim=32, num_message_passing_steps=1)
    model = create("orb_v2", seed=5, **small)
    plain = weights_digest(model)
    to_float64(model)
    assert weights_digest(model) == plain
    name, param = next((n, p) for n, p in model.parameters_and_names() if p.dtype == ms.float64 and p.size > 1)
    values = param.asnumpy().copy()
    values.flat[0] += 1e-12 * max(1.0, abs(values.flat[0]))  # between two float32 values
    param.set_data(Tensor(values))
    assert weights_digest(model) != plain, name


def test_a_full_disk_is_one_line_and_other_os_errors_keep_their_traceback(capsys):
    """run_command turns a file-system fault (a full disk, a quota, an I/O error, a read-only file system) into one
    line, exit 1; any other OSError (a library that does not load, a wrong path in the code) keeps its traceback: it
    printed 'error: OSError' and hid the file."""
    import errno

    from orb.signals import run_command

    def fail(error):
        def body():
            raise error
        return body

    assert run_command(fail(OSError(errno.ENOSPC, "No space left on device", "/scratch/x")), "--resume") == 1
    assert capsys.readouterr().err.strip() == ("error: No space left on device (/scratch/x): free space, then run the "
                                               "same command again (--resume)")
    with pytest.raises(OSError, match="cannot open shared object file"):
        run_command(fail(OSError("/tmp/x.so: cannot open shared object file")))


PROGRAM = """
import sys
from orb.signals import is_program, run_program

def main():
    print("the program:", is_program())
    return 3

if __name__ == "__main__":
    run_program(main)
"""
DRIVER = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    print("driver went on after", stop.code)
"""
INSTALLED = """
import re, sys
from orb.programs import program
if __name__ == "__main__":  # (pip's wrapper of a console script)
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(program("command")())
"""


@pytest.mark.parametrize("case", ["script", "module", "installed", "driver"])
def test_a_command_knows_it_is_the_program_and_exits_with_mains_status(tmp_path, case):
    """run_program (every command's __main__, and orb.programs for the installed commands): sys.exit(main()), the
    process marked as the command's program (orb.device.import_mindspore then freezes MindSpore's objects); a
    program that runpy runs inside a driver is not marked (the driver's objects are not the command's)."""
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "command.py").write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    command = {"script": [str(tmp_path / "command.py")], "module": ["-m", "command"],
               "installed": [str(tmp_path / "orb-command")], "driver": ["-c", DRIVER, str(tmp_path / "command.py")]}
    (tmp_path / "orb-command").write_text(INSTALLED)
    result = subprocess.run([sys.executable, *command[case]], capture_output=True, text=True, env=env, timeout=60)
    if case == "driver":
        assert (result.returncode, result.stdout) == (0, "the program: False\ndriver went on after 3\n"), result
    else:
        assert (result.returncode, result.stdout) == (3, "the program: True\n"), result


IMPORTS = """
import gc, sys
from orb.device import import_mindspore
from orb.signals import run_command, run_program

collecting, importing = [], [False]
gc.callbacks.append(lambda phase, info: collecting.append(info["generation"]) if importing[0] else None)

def imported():
    importing[0] = True
    import_mindspore()
    importing[0] = False
    return 0

def main():
    if sys.argv[1] == "library":
        imported()
    else:
        run_command(imported)
    print(collecting, gc.get_freeze_count() > 0, gc.isenabled(), flush=True)
    return 0

if sys.argv[1] == "program":
    run_program(main)
main()
"""


@pytest.mark.parametrize("case", ["program", "library", "main from Python"])
def test_mindspores_import_is_never_collected_and_a_program_freezes_it(case):
    """import_mindspore: no garbage collection while MindSpore's 160,000 objects are made (its full collections walked
    them again and again), the collector on again after it; in a command's program (run_program) they are frozen
    out of it for the rest of the process. orb as a library, a command's main called from Python included, leaves
    its caller's objects to the collector."""
    import subprocess
    import sys

    from conftest import ROOT

    result = subprocess.run([sys.executable, "-c", IMPORTS, case.split()[0]], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == ("[] True True" if case == "program" else "[] False True")


@pytest.mark.parametrize("online", [True, False])
def test_online_normalisation_off_keeps_the_starting_normalisers_through_a_step(online):
    """The label-free template trains with online_normalisation: false: the energy, force and stress normalisers keep
    the starting model's statistics bit for bit while the weights move; on (orb-models' way) they absorb the batch."""
    import mindspore as ms

    from orb.data.buckets import Bucket
    from orb.data.tensors import loss_arrays
    from orb.models import create
    from orb.training.config import config_from_dict
    from orb.training.distributed import DataParallel
    from orb.training.engine import Engine

    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = config_from_dict(dict(train_data_path=DEMO_TRAIN, device_target="CPU", model=dict(SMALL_MODEL),
                                lr_schedule="constant", online_normalisation=online))
    bucket = Bucket(64, 1280, 5)
    engine = Engine(create("orb_v2", seed=1, **SMALL_MODEL), cfg, DataParallel(), True, 10)
    before = {n: p.asnumpy().copy() for n, p in engine.model.parameters_and_names()}
    engine.train(loss_arrays(small_batch((0, 1, 2, 3), bucket)), bucket)
    after = {n: p.asnumpy() for n, p in engine.model.parameters_and_names()}
    statistics = [n for n in before if ".normalizer." in n and n.endswith(("running_mean", "running_var"))]
    assert {n.split(".normalizer")[0] for n in statistics} == {"graph_head", "node_head", "stress_head"}, statistics
    moved = [n for n in statistics if not np.array_equal(before[n], after[n])]
    assert any(not np.array_equal(before[n], after[n]) for n in before if n not in statistics)
    assert moved == (statistics if online else []), moved


def test_compiled_steps_time_their_second_run_once_and_report_it(monkeypatch):
    """A restart's overhead is each graph's first run beyond its second (the step's own work), not the first run:
    the second run of each graph is timed once (later runs are not: no extra wait on the host), each call returns
    its own outputs, and the closing line gives both runs."""
    import mindspore as ms
    from mindspore import nn, ops

    from orb.data.buckets import Bucket
    from orb.training import engine
    from orb.training.engine import Compiled

    class Square(nn.Cell):
        def construct(self, x):
            return ops.matmul(x, x)

    waits = []
    wait_for = engine._wait_for
    monkeypatch.setattr(engine, "_wait_for", lambda out: waits.append(1) or wait_for(out))
    ms.set_context(mode=ms.GRAPH_MODE)
    compiled, cell = Compiled(), Square()
    small, large = Bucket(8, 16, 2), Bucket(12, 24, 2)
    seconds = []
    for scale in (1, 2, 3):
        x = np.eye(8, dtype=np.float32) * scale
        np.testing.assert_array_equal(compiled.run("eval", cell, [x], small).asnumpy(), x @ x)
        seconds.append(dict(compiled.second_run_seconds))
    assert len(waits) == 2  # the first run and the second, not the third
    assert seconds[0] == {} and seconds[2] == seconds[1] and set(seconds[1]) == {("eval", small)}
    compiled.run("eval", cell, [np.eye(12, dtype=np.float32)], large)
    assert set(compiled.seconds) == {("eval", small), ("eval", large)}
    assert set(compiled.second_run_seconds) == {("eval", small)}  # the large one ran once
    second = compiled.second_run_seconds[("eval", small)]
    assert 0 < second < compiled.seconds[("eval", small)]
    assert compiled.describe().startswith(f"eval 8x16 {compiled.seconds[('eval', small)]:.2f}s (then {second:.2f}s), "
                                          f"eval 12x24 {compiled.seconds[('eval', large)]:.2f}s; 0 of 2 from the")


SHORT_WRITE = """
import json, os, resource, signal, sys
from orb.files import append_record, read_records

path = sys.argv[1]
append_record(path, {"type": "step", "step": 1})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a file size limit: the kernel cuts the write short, as a full disk)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 10, hard))
try:
    append_record(path, {"type": "step", "step": 2, "loss": 0.123456789})
    print("no error")
except OSError as exc:
    print("error", exc.errno, exc.filename == path)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
append_record(path, {"type": "step", "step": 3})  # (space again)
print(json.dumps([r["step"] for r in read_records(path)]))
"""


def test_an_append_the_disk_cuts_short_is_undone_and_said():
    """metrics.jsonl's lines (and orb-md's uncertain frames) were one os.write whose short count went unchecked: a
    full disk left part of a line, the next record was glued to it and both were lost (a resume then dropped the cut
    line for good). Now the append is undone and raises the write's error (here the size limit's EFBIG; a full disk's
    ENOSPC) naming the file; the next append is whole."""
    import errno
    import subprocess
    import sys
    import tempfile

    from conftest import ROOT

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "metrics.jsonl")
        result = subprocess.run([sys.executable, "-c", SHORT_WRITE, path], capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, PYTHONPATH=ROOT))
        assert result.stdout.splitlines() == [f"error {errno.EFBIG} True", "[1, 3]"], result.stdout + result.stderr
