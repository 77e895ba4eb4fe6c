"""The trade-off between the target's gain and the foundation's drift: stated at the end of a fine-tuning run with
replay, and shown before one by scripts/compare_strategies.py (the frontier of a grid of settings and the one it
recommends)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import DEMO_TRAIN, DEMO_VAL, ROOT, SMALL_MODEL
from test_replay import PRETRAIN_TRAIN, copy_rows, records
from test_training import make_cfg, trainer_for

KEYS = ("energy_per_atom_mae", "forces_mae")


def pct(now, start):
    return 100.0 * (now - start) / start


@pytest.mark.parametrize("labels", ["data", "model"])
def test_a_replay_run_ends_with_its_trade_off_line_and_record(tmp_path, caplog, labels):
    """After the last epoch (not after an interrupted part of the run), one ``trade_off`` record: for the epoch
    with the lowest validation + held-out replay loss (in_selection) and for the last epoch, the validation MAEs
    against epoch 0's in %, and replay_val's in % (labels: data) or as the drift itself (labels: model, where
    epoch 0's replay_val error is 0); the log line states the same numbers."""
    replay = dict(data_path=copy_rows(PRETRAIN_TRAIN, tmp_path / "replay.db", 24), fraction=0.25, val_samples=6,
                  selection="random", labels=labels, in_selection=True)
    cfg = dict(train_data_path=copy_rows(DEMO_TRAIN, tmp_path / "train.db", 16), replay=replay, max_epochs=3)
    if labels == "model":  # the starting weights that label the replay structures
        from orb.io.checkpoint import save_checkpoint
        from orb.models import create

        save_checkpoint(str(tmp_path / "start.ckpt"), create("orb_v2", seed=7, **SMALL_MODEL), exported=True)
        cfg["checkpoint_path"] = str(tmp_path / "start.ckpt")
    caplog.set_level("INFO", logger="orb")
    first = trainer_for(make_cfg(tmp_path, **cfg))
    first.fit(until_epoch=2)
    run = tmp_path / "run"
    assert not records(run, "trade_off") and "trade-off" not in caplog.text  # not the end of the run
    trainer_for(make_cfg(tmp_path, **cfg), resume=str(run)).fit()
    trainer_for(make_cfg(tmp_path, **cfg), resume=str(run)).fit()  # a finished run resumed: no second record
    (record,) = records(run, "trade_off")
    initial = records(run, "initial")[0]
    epochs = {r["epoch"]: r for r in records(run, "epoch")}
    best = min(epochs, key=lambda e: epochs[e]["val"]["loss"] + epochs[e]["replay_val"]["loss"])
    assert record["best"]["epoch"] == best and record["final"]["epoch"] == 3 == record["epoch"]
    assert record["step"] == epochs[3]["step"]
    for kind in ("best", "final"):
        now = epochs[record[kind]["epoch"]]
        for k in KEYS:
            assert record[kind]["target"][k] == pytest.approx(pct(now["val"][k], initial["val"][k]), rel=1e-12)
            if labels == "data":
                assert record[kind]["foundation"][k] == pytest.approx(
                    pct(now["replay_val"][k], initial["replay_val"][k]), rel=1e-12)
            else:
                assert initial["replay_val"][k] < 1e-4  # against its own predictions: no % of it
                assert record[kind]["foundation_drift"][k] == now["replay_val"][k] > 0
    lines = [line for line in caplog.text.splitlines() if "trade-off of best_weights.ckpt" in line]
    assert len(lines) == 1
    final = epochs[3]
    stated = (f"final weights (epoch 3): target {pct(final['val'][KEYS[0]], initial['val'][KEYS[0]]):+.1f} %, "
              f"{pct(final['val'][KEYS[1]], initial['val'][KEYS[1]]):+.1f} %")
    assert stated in lines[0]
    assert f"(epoch {best}): target energy_per_atom_mae " in lines[0]


def synthetic_results():
    """A starting model and five settings' best and final weights: target and foundation MAEs."""
    start = {"target": {"energy_per_atom_mae": 0.1, "forces_mae": 0.2},
             "foundation": {"energy_per_atom_mae": 0.08, "forces_mae": 0.3}}

    def row(target_f, foundation_e, foundation_f, target_e=0.05):
        return {"target": {"energy_per_atom_mae": target_e, "forces_mae": target_f},
                "foundation": {"energy_per_atom_mae": foundation_e, "forces_mae": foundation_f}}

    return start, {
        "starting model": start,
        "none, best": row(0.10, 0.096, 0.30), "none, final": row(0.11, 0.092, 0.29),  # -50/-45 %; +20 %
        "A, best": row(0.12, 0.0824, 0.29), "A, final": row(0.118, 0.08, 0.306),  # -40 %; +3 % (E best), +2 % F
        "B, best": row(0.14, 0.0792, 0.297), "B, final": row(0.13, 0.079, 0.29),  # -30 %; -1 %
        "C, best": row(0.13, 0.0832, 0.30), "C, final": row(0.12, 0.08, 0.31),  # -35 %; +4 %: beaten by A
        "D, best": row(0.112, 0.088, 0.30), "D, final": row(0.11, 0.08, 0.321),  # -44 %; +10 % (E best), +7 % F
        "E, best": row(0.05, 0.07, 0.2),  # its final weights not measured yet: left out
    }


def test_the_settings_are_judged_by_their_worst_weights_and_the_frontier_keeps_the_unbeaten():
    from orb.reports import frontier as fr

    start, results = synthetic_results()
    settings = {s.name: s for s in fr.summarise(results)}
    assert list(settings) == ["none", "A", "B", "C", "D"]
    a = settings["A"]
    assert a.drift == pytest.approx(3.0) and a.gain == pytest.approx(40.0)  # worst of E/F and of best/final
    assert settings["none"].gain == pytest.approx(45.0) and settings["none"].kept == pytest.approx(100.0)
    assert a.kept == pytest.approx(100 * 40 / 45)
    assert settings["D"].drift == pytest.approx(10.0) and settings["B"].drift == pytest.approx(-1.0)
    assert a.changes["final"]["foundation"]["forces_mae"] == pytest.approx(2.0)
    assert a.energy_gain == pytest.approx(50.0)
    assert [s.name for s in fr.frontier(list(settings.values()))] == ["B", "A", "D", "none"]
    rows = {line.split(" | ")[0][2:]: line for line in fr.table(list(settings.values()), a, 5.0, 80.0)[2:]}
    assert rows["**A** (recommended)"].endswith("| +3.0 % | +2.0 % | +40.0 % | 89 % | +50.0 % | yes | yes |")
    assert rows["B"].endswith("| 67 % | +50.0 % |  | yes |") and rows["C"].endswith("|  |  |")


@pytest.mark.parametrize("tolerance, min_kept, chosen, said", [
    (5.0, 80.0, "A", "the largest target force gain"),  # A and B within 5 %: A gains more
    (2.0, 80.0, "B", "the largest target force gain"),  # only B within 2 %
    (-5.0, 80.0, "A", "at least 80 % of plain"),  # none within: the least drift keeping 80 %
    (-5.0, 99.0, "none", "at least 99 % of plain"),  # only plain keeps 99 %
    (-5.0, 101.0, "B", "none keeps 101 %"),  # nothing keeps 101 %: the least drift of all
])
def test_the_recommendation_is_the_largest_gain_within_the_tolerance_else_a_compromise_said(tolerance, min_kept,
                                                                                              chosen, said):
    from orb.reports import frontier as fr

    _, results = synthetic_results()
    settings = fr.summarise(results)
    best, reason = fr.recommend(settings, tolerance, min_kept)
    assert best.name == chosen and said in reason
    assert ("compromise" in reason) == (tolerance < 0)
    assert fr.recommend([], tolerance, min_kept)[0] is None


def test_the_recommended_block_is_a_config_that_sets_the_setting(tmp_path):
    """Each setting's YAML block passes the config checker and sets exactly the keys its runs set (replay reset
    included: the block of 'anchor 10' pasted into a config with replay was anchor and replay); its command-line
    form is what finetune.py reads as the same values."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import compare_strategies as cs

    from orb.bundled import template_path
    from orb.reports.frontier import config_block
    from orb.training.config import config_from_dict, flatten, load_config
    from orb.training.config_files import _merge, read_yaml

    template = read_yaml(open(template_path("finetune_orb_v3"), encoding="utf-8").read(), "template")
    for name in cs.STRATEGIES:
        settings = cs.measured(name, "replay.xyz")
        assert cs.REPLAY not in json.dumps(settings)
        pasted = flatten(config_from_dict(_merge(template, read_yaml(config_block(settings), name) or {})).to_dict())
        typed = flatten(load_config("finetune_orb_v3", cs.command_line(settings)).to_dict())
        for key, value in settings.items():
            assert pasted[key] == value == typed[key], (name, key)
    assert "no protection" in config_block({})
    anchored = read_yaml(config_block(cs.measured("anchor 10", "replay.xyz")), "anchor 10")
    assert anchored["replay"]["fraction"] == 0.0 and anchored["anchor"]["weight"] == 10


def test_compare_strategies_on_a_users_target_recommends_and_continues(tmp_path):
    """The user's mode end to end, 2 settings of 1 epoch on small files from the demo model: a stop to the study
    while its first fine-tuning runs reaches the fine-tuning, and the study exits 75 (it died at once, its
    fine-tuning left running, or ignored the stop after its first evaluation); run again, it continues to results,
    table, frontier.json with a recommendation and its block, frontier.png; run again, it measures nothing twice."""
    train = copy_rows(DEMO_TRAIN, tmp_path / "train.db", 16)
    val = copy_rows(DEMO_VAL, tmp_path / "val.db", 8)
    replay = copy_rows(PRETRAIN_TRAIN, tmp_path / "replay.db", 48)
    foundation = copy_rows(PRETRAIN_TRAIN, tmp_path / "foundation.db", 8, start=100)
    out = tmp_path / "study"
    config = tmp_path / "study.yaml"  # the demo's, in one batch shape (its two buckets: 8 graphs for 2 steps a run)
    config.write_text(open(os.path.join(ROOT, "configs", "demo.yaml")).read().replace("data/", ROOT + "/data/")
                      .replace("num_buckets: 2", "buckets: [[136, 2720]]"))
    command = [sys.executable, os.path.join(ROOT, "scripts", "compare_strategies.py"), "--train", train, "--val",
               val, "--replay", replay, "--foundation", foundation, "--config", str(config), "--epochs", "1",
               "--out", str(out), "--only", "none,pseudo-label replay 0.25 + selection"]
    env = dict(os.environ, ORB_CACHE_DIR=str(tmp_path / "cache"))
    study = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 600
    while not (out / "none.log").exists() or not (out / "none.log").read_text().strip():  # fine-tuning, listening
        assert study.poll() is None and time.monotonic() < deadline, study.communicate()
        time.sleep(0.2)
    study.send_signal(signal.SIGTERM)  # to the study alone
    _, err = study.communicate(timeout=600)
    assert study.returncode == 75 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"stopped by SIGTERM: the fine-tuning into {out / 'none'} saved"), err
    assert "stopped by SIGTERM" in (out / "none.log").read_text()  # (forwarded: it stopped itself)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.load(open(out / "frontier.json"))
    assert [s["name"] for s in report["settings"]] == ["none", "pseudo-label replay 0.25 + selection"]
    assert report["recommended"] in ("none", "pseudo-label replay 0.25 + selection")
    assert f"Recommended: {report['recommended']}" in done.stdout and report["config"].strip() in done.stdout
    results = json.load(open(out / "results.json"))
    assert set(results) == {"starting model"} | {f"{n}, {k}" for n in ("none", "pseudo-label replay 0.25 + "
                                                                        "selection") for k in ("best", "final")}
    for setting in report["settings"]:  # the report is the results' numbers
        for kind in ("best", "final"):
            now, start = results[f"{setting['name']}, {kind}"], results["starting model"]
            assert setting["changes"][kind]["foundation"]["forces_mae"] == pytest.approx(
                pct(now["foundation"]["forces_mae"], start["foundation"]["forces_mae"]))
    selected = out / "pseudo-label_replay_0.25_and_selection"
    assert records(selected, "trade_off")  # each run states its own trade-off too
    assert os.path.getsize(out / "frontier.png") > 0 and (out / "table.md").exists()
    stamp = os.path.getmtime(out / "none.log")
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and "done in" not in again.stderr
    assert os.path.getmtime(out / "none.log") == stamp
    # another study in the same folder (its results were reported as this one's): refused, the results as they were
    before = (out / "results.json").read_text()
    other = subprocess.run(command[:-4] + ["--epochs", "2"] + command[-4:], capture_output=True, text=True,
                           timeout=600, env=env)
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and len(lines) == 1 and "holds the results of another study (epochs 1 -> 2)" in \
        lines[0], other.stderr
    assert (out / "results.json").read_text() == before


def test_a_foundation_error_of_zero_at_the_start_is_given_as_the_drift_itself():
    """labels: data on replay structures whose labels are the starting model's own predictions: replay_val starts at
    0, which has no % change (it ended the run with ZeroDivisionError after its last epoch, and every resume again)."""
    from orb.training.reporting import format_trade_off, trade_off

    zero = {"energy_per_atom_mae": 0.0, "forces_mae": 0.0}
    records_ = [{"type": "initial", "val": {"energy_per_atom_mae": 0.1, "forces_mae": 0.2}, "replay_val": zero},
                {"type": "epoch", "epoch": 1, "val": {"energy_per_atom_mae": 0.05, "forces_mae": 0.1},
                 "replay_val": {"energy_per_atom_mae": 0.01, "forces_mae": 0.02}}]
    record = trade_off(records_, 1, 1, pseudo_labels=False)
    assert record["final"]["target"] == {"energy_per_atom_mae": -50.0, "forces_mae": -50.0}
    assert record["final"]["foundation_drift"] == {"energy_per_atom_mae": 0.01, "forces_mae": 0.02}
    assert "foundation drift (replay_val against the starting model's predictions) 0.01 eV/atom" in \
        format_trade_off(record)
