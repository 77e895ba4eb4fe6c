"""orb-md: many structures advanced by ASE's own integrators with one batched model call per step -- the same
trajectories as ASE's integrators driving the calculator structure by structure (NVE, and Langevin NVT with the
same seeds); a stopped or killed run resumes to the uninterrupted run's end; uncertain frames collected; bad
input one line, a structure that cannot be computed named while the others go on."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT, noting_mindspore

V3 = os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")
ROWS = (1, 5, 9)  # periodic cells of 8-16 atoms


def start_frames(tmp_path):
    """Three demo structures with Maxwell-Boltzmann momenta (the data's momenta are orb-md's initial velocities)."""
    import ase.db
    import ase.io
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    frames = []
    for k, row in enumerate(ROWS):
        atoms = ase.db.connect(DEMO_VAL).get(row).toatoms()
        atoms.calc = None
        MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(k))
        frames.append(atoms)
    path = str(tmp_path / "start.extxyz")
    ase.io.write(path, frames, format="extxyz")
    return path, frames


def orb_md(tmp_path, name, *args, timeout=900, noting=False):
    """orb-md's run; ``noting``: its last line of output says whether it imported MindSpore."""
    command = [sys.executable, "scripts/md.py", "--checkpoint", V3, "--output", str(tmp_path / name),
               "--device_target", "CPU", "--progress_bar", "false", *args]
    return subprocess.run(noting_mindspore(command) if noting else command, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def last_frames(folder, count):
    import ase.io

    return [ase.io.read(os.path.join(folder, f"traj_{k}.extxyz"), index=-1) for k in range(count)]


@pytest.mark.parametrize("ensemble", ["nve", "nvt"])
def test_batched_dynamics_follow_ases_integrators_structure_by_structure(tmp_path, ensemble):
    """20 steps of 1 fs: every structure ends where ASE's VelocityVerlet (or Langevin with the structure's seed)
    driving ORBCalculator alone takes it, to 1e-5 Å, and the NVE total energy is conserved."""
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    from orb.inference.calculator import ORBCalculator

    path, frames = start_frames(tmp_path)
    result = orb_md(tmp_path, "md", "--data", path, "--ensemble", ensemble, "--timestep", "1", "--steps", "20",
                    "--write_every", "10", "--temperature", "300", "--seed", "7")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = last_frames(tmp_path / "md", len(frames))
    calculator = ORBCalculator.from_checkpoint(V3, device_target="CPU")
    for k, atoms in enumerate(frames):
        atoms.calc = calculator
        if ensemble == "nve":
            dynamics = VelocityVerlet(atoms, timestep=1 * units.fs)
        else:
            dynamics = Langevin(atoms, timestep=1 * units.fs, temperature_K=300, friction=0.01 / units.fs,
                                rng=np.random.default_rng([7, k]), fixcm=False)
        dynamics.run(20)
        np.testing.assert_allclose(ours[k].positions, atoms.positions, atol=1e-5, err_msg=f"structure {k}")
        assert ours[k].info["step"] == 20
    summary = json.load(open(tmp_path / "md" / "summary.json"))
    assert [s["status"] for s in summary["structures"]] == ["done"] * len(ROWS) and summary["model_calls"] == 21
    assert summary["compile_seconds"] > 0  # the time a user waits before the first step
    if ensemble == "nve":
        for s in summary["structures"]:
            assert abs(s["total_energy_drift_eV_per_atom"]) < 2e-3
    log = np.genfromtxt(tmp_path / "md" / "log_0.csv", delimiter=",", names=True)
    assert list(log["step"]) == [0, 10, 20] and np.all(log["temperature_K"] > 0)
    assert summary["structures"][0]["max_temperature_K"] == pytest.approx(log["temperature_K"].max(), rel=1e-9)
    assert "warning" not in result.stderr  # (in bounds: no runaway said)


def test_a_structure_the_model_heats_without_bound_is_said_to_have_run_away(tmp_path):
    """The orb-v3 demo (trained on metals) on a water molecule: 500,000 K within 40 steps, and the summary said
    "2 of 2 structures ran 40 steps" and nothing else."""
    import ase.io
    from ase.build import molecule

    ase.io.write(tmp_path / "molecules.extxyz", [molecule("H2O"), molecule("CH4")], format="extxyz")
    result = orb_md(tmp_path, "md", "--data", str(tmp_path / "molecules.extxyz"), "--timestep", "1", "--steps", "40",
                    "--temperature", "300")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(tmp_path / "md" / "summary.json"))
    from orb.inference.md import ran_away

    assert not ran_away(2200.0, 2300.0, 300.0) and ran_away(300.0, 1500.0, 300.0)  # (velocities of its own: 2,200 K)
    hottest = max(summary["structures"], key=lambda s: s["max_temperature_K"])
    assert hottest["max_temperature_K"] > 1400 and (  # named by its file and frame (it was "row 2")
        f"(structure {hottest['index']}, {tmp_path / 'molecules.extxyz'}, frame {hottest['index']}: "
        f"{hottest['max_temperature_K']:,.0f} K in its log): the model is likely unfit") in result.stderr, \
        result.stderr[-2000:]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stopped_or_killed_run_resumes_to_the_uninterrupted_end(tmp_path, how):
    """SIGTERM saves every structure at the step in progress and exits 75; SIGKILL leaves the states of the last
    written frames. --resume cuts trajectories and logs back to the states and ends where the uninterrupted run
    ends (Langevin: its random generators' states saved too)."""
    path, frames = start_frames(tmp_path)
    common = ["--data", path, "--ensemble", "nvt", "--timestep", "1", "--steps", "30", "--write_every", "5",
              "--seed", "3", "--uncertain_above", "0.12"]
    assert orb_md(tmp_path, "straight", *common).returncode == 0
    process = subprocess.Popen([sys.executable, "scripts/md.py", "--checkpoint", V3, "--output",
                                str(tmp_path / "broken"), "--device_target", "CPU", "--progress_bar", "false",
                                *common], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "broken" / f"log_{len(ROWS) - 1}.csv"
    deadline = time.time() + 600
    while not (log.exists() and len(open(log).read().splitlines()) >= 4):  # header + steps 0, 5, 10
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.05)
    process.send_signal(getattr(signal, how))
    _, err = process.communicate(timeout=300)
    if how == "SIGTERM":
        assert process.returncode == 75 and "Traceback" not in err, err[-2000:]
        assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM")
    steps = [json.load(open(tmp_path / "broken" / f"state_{k}.json"))["step"] for k in range(len(ROWS))]
    assert max(steps) < 30
    resumed = orb_md(tmp_path, "broken", *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for a, b in zip(last_frames(tmp_path / "straight", len(ROWS)), last_frames(tmp_path / "broken", len(ROWS))):
        np.testing.assert_allclose(a.positions, b.positions, atol=1e-6)
        np.testing.assert_allclose(a.get_momenta() if "momenta" in a.arrays else 0,
                                   b.get_momenta() if "momenta" in b.arrays else 0, atol=1e-6)
    for k in range(len(ROWS)):
        straight = open(tmp_path / "straight" / f"log_{k}.csv").read().splitlines()
        again = open(tmp_path / "broken" / f"log_{k}.csv").read().splitlines()
        assert [line.split(",")[0] for line in again] == [line.split(",")[0] for line in straight]  # no step twice
    import ase.io

    for folder in ("straight", "broken"):
        uncertain = ase.io.read(tmp_path / folder / "uncertain.extxyz", index=":")
        assert uncertain and all(f.info["predicted_force_error_max"] > 0.12 for f in uncertain)
    keys = lambda folder: [(f.info["step"], f.info["structure"]) for f in  # noqa: E731
                           ase.io.read(tmp_path / folder / "uncertain.extxyz", index=":")]
    assert keys("broken") == keys("straight") == sorted(keys("straight"))  # none lost, none twice; one order


def test_bad_input_is_one_line_and_a_broken_structure_is_named_while_the_others_run(tmp_path):
    import ase.io

    path, frames = start_frames(tmp_path)
    for args, message in ((["--timestep", "0"], "--timestep must be a finite number > 0, got 0.0"),
                          (["--timestep", "1", "--temperature", "-5"],
                           "--temperature must be a finite number >= 0, got -5.0"),
                          (["--timestep", "1", "--ensemble", "nvt", "--thermostat", "nose-hoover", "--temperature",
                            "0"], "--temperature must be > 0 for --thermostat nose-hoover; at 0 K use --thermostat "
                                  "langevin (a quench) or orb-relax"),  # NaN positions, each structure blamed
                          (["--timestep", "1", "--ensemble", "npt", "--temperature", "0"],
                           "--temperature must be > 0 for --ensemble npt (Berendsen); at 0 K use --thermostat "
                           "langevin (a quench) or orb-relax"),
                          (["--timestep", "1", "--ensemble", "npt", "--pressure", "nan"],  # a NaN cell, every
                           "--pressure must be a finite number (bar), got nan"),          # structure "failed"
                          (["--timestep", "1", "--pressure", "50000"],  # (it ran NVE at constant volume,
                           "--pressure 50000.0 applies to --ensemble npt, and this run is --ensemble nve: give "  # and
                           "--ensemble npt, or leave --pressure out"),  # its run.json recorded the pressure)
                          (["--timestep", "1", "--ensemble", "nvt", "--tdamp", "5"],
                           "--tdamp 5.0 applies to --ensemble nvt --thermostat nose-hoover, and this run is --ensemble "
                           "nvt --thermostat langevin: give --ensemble nvt --thermostat nose-hoover, or leave --tdamp "
                           "out"),
                          (["--timestep", "1", "--resume", "--overwrite"],  # (it was --resume, silently)
                           "--resume continues the earlier run and --overwrite replaces it: give one of them")):
        result = orb_md(tmp_path, "bad", "--data", path, "--steps", "5", *args, noting=True)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {message}"], result.stderr
        assert result.stdout.split() == ["False"]  # said before MindSpore's 1 s import
    (tmp_path / "afile").write_text("a file")  # ("cannot create it (File exists)")
    result = orb_md(tmp_path, "afile", "--data", path, "--timestep", "1", "--steps", "5", noting=True)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --output {tmp_path / 'afile'}: {tmp_path / 'afile'} is a file, not a folder"], result.stderr
    overlapping = frames[1].copy()
    overlapping.positions[1] = overlapping.positions[0]  # two atoms at one place: no graph
    ase.io.write(tmp_path / "mixed.extxyz", [frames[0], overlapping, frames[2]], format="extxyz")
    result = orb_md(tmp_path, "mixed", "--data", str(tmp_path / "mixed.extxyz"), "--timestep", "1", "--steps", "10",
                    "--ensemble", "nve")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    mixed = tmp_path / "mixed.extxyz"  # named by its file and frame (it was "row 2"), in the summary and frames too
    assert len(lines) == 1 and lines[0].startswith(f"structure 1 ({mixed}, frame 1) stopped:"), lines
    summary = json.load(open(tmp_path / "mixed" / "summary.json"))
    assert [s["status"] for s in summary["structures"]] == ["done", "failed", "done"]
    assert [(s["source_file"], s["source_frame"]) for s in summary["structures"]] == [(str(mixed), k) for k in range(3)]
    assert ase.io.read(tmp_path / "mixed" / "traj_2.extxyz", index=-1).info["source_frame"] == 2


def test_structures_are_checked_before_the_first_step(tmp_path):
    """A NaN velocity, a zero mass or a NaN position: refused before the first step in one line naming file, frame and
    key (the run started, wrote a frame of NaN momenta, and blamed the structure's positions, exit 1)."""
    import ase.io

    path, frames = start_frames(tmp_path)
    for key, message in (("momenta", "momenta contain NaN or inf"), ("masses", "masses must be finite and > 0"),
                         ("positions", "")):
        bad = frames[1].copy()
        if key == "momenta":
            bad.arrays["momenta"][0, 1] = np.nan
        elif key == "masses":
            bad.set_masses([0.0] * len(bad))
        else:
            bad.positions[0, 0] = np.nan
        ase.io.write(tmp_path / f"{key}.extxyz", [frames[0], bad], format="extxyz")
        result = orb_md(tmp_path, key, "--data", str(tmp_path / f"{key}.extxyz"), "--timestep", "1", "--steps", "2")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
        assert lines[0].startswith(f"error: {tmp_path / f'{key}.extxyz'}, frame 1, key '{key}': {message}"), lines
        assert not (tmp_path / key / "traj_0.extxyz").exists()
    # a stored label orb-md discards is not checked: a NaN in a row's forces (a failed DFT run) starts as any other
    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    with ase.db.connect(str(tmp_path / "nan_label.db")) as db:
        for k, atoms in enumerate(frames[:2]):
            copy = atoms.copy()
            forces = np.zeros((len(copy), 3))
            forces[0, 0] = np.nan if k == 1 else 0.0
            copy.calc = SinglePointCalculator(copy, energy=-1.0, forces=forces)
            db.write(copy)
    result = orb_md(tmp_path, "nan_label", "--data", str(tmp_path / "nan_label.db"), "--timestep", "1", "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]


def test_extending_a_run_and_stopping_uncertain_structures_survive_a_resume(tmp_path):
    """A run of 0 steps (its state at step 0) extended with --resume writes frame 0 once (ASE observes step 0
    again), and so does a structure killed between its first frame and its first state (it starts again: its
    frame was written twice); a structure --stop_uncertain stopped keeps its stopping frame and stays stopped on
    --resume; other settings or other structures on --resume are refused in one line, and a refused --overwrite
    deletes nothing."""
    import ase.io

    path, frames = start_frames(tmp_path)
    common = ["--data", path, "--ensemble", "nve", "--timestep", "1", "--write_every", "3"]
    first = orb_md(tmp_path, "md", *common, "--steps", "0", "--resume")  # (a requeue script's first start)
    assert first.returncode == 0 and f"--resume: {tmp_path / 'md'} holds no earlier run to continue: starting it" \
        in first.stderr, first.stderr[-2000:]
    os.remove(tmp_path / "md" / "state_1.json")  # killed after structure 1's step-0 frame, before its state
    settings = json.load(open(tmp_path / "md" / "run.json"))  # as the previous version wrote it: resumed, completed
    json.dump({k: v for k, v in settings.items() if k not in ("weights_digest", "data_fingerprint")},
              open(tmp_path / "md" / "run.json", "w"))
    stale = tmp_path / "md" / ".state_1.json.tmp-999999-0badc0de"  # that write's temporary, an hour old
    stale.write_text("{")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert orb_md(tmp_path, "md", *common, "--steps", "6", "--resume").returncode == 0
    assert not stale.exists()
    assert json.load(open(tmp_path / "md" / "run.json")) == dict(settings, steps=6)  # completed, the larger --steps
    for k in (0, 1):
        log = np.genfromtxt(tmp_path / "md" / f"log_{k}.csv", delimiter=",", names=True)
        assert list(log["step"]) == [0, 3, 6], k
        assert [f.info["step"] for f in ase.io.read(tmp_path / "md" / f"traj_{k}.extxyz", index=":")] == [0, 3, 6]
    refused = orb_md(tmp_path, "md", *common[:-4], "--timestep", "2", "--write_every", "3", "--steps", "9",
                     "--resume")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: --resume {tmp_path / 'md'}: these settings differ from the run's: timestep: 1.0 -> 2.0. Restore "
        "them, or start a new run in another --output"]
    ase.io.write(tmp_path / "other.extxyz", frames[::-1], format="extxyz")  # the structures in another order
    other = orb_md(tmp_path, "md", "--data", str(tmp_path / "other.extxyz"), *common[2:], "--steps", "9", "--resume")
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and len(lines) == 1 and "data_fingerprint:" in lines[0], other.stderr[-2000:]
    kept = {name: os.path.getsize(tmp_path / "md" / name) for name in os.listdir(tmp_path / "md")}
    for bad in (["--stop_uncertain"], ["--data", str(tmp_path / "missing.extxyz")]):  # refused before, after the model
        overwrite = orb_md(tmp_path, "md", *common, "--steps", "9", "--overwrite", *bad)
        lines = overwrite.stderr.strip().splitlines()
        assert overwrite.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), overwrite.stderr
        assert {name: os.path.getsize(tmp_path / "md" / name) for name in os.listdir(tmp_path / "md")} == kept
    stopping = common + ["--uncertain_above", "0.12", "--stop_uncertain", "--steps", "6"]
    assert orb_md(tmp_path, "stop", *stopping).returncode == 0
    first = json.load(open(tmp_path / "stop" / "summary.json"))["structures"]
    stopped = [s["index"] for s in first if s["status"] == "stopped: uncertain"]
    assert stopped
    for k in stopped:  # its stopping frame is in its trajectory and in uncertain.extxyz
        frames = ase.io.read(tmp_path / "stop" / f"traj_{k}.extxyz", index=":")
        assert frames[-1].arrays["predicted_force_error"].max() > 0.12
    collected = ase.io.read(tmp_path / "stop" / "uncertain.extxyz", index=":")  # each names its file and frame
    assert collected and all((f.info["source_file"], f.info["source_frame"]) == (path, f.info["structure"])
                             for f in collected)
    assert orb_md(tmp_path, "stop", *stopping, "--resume").returncode == 0
    again = json.load(open(tmp_path / "stop" / "summary.json"))["structures"]
    assert [s["status"] for s in again] == [s["status"] for s in first]


def run_and_stop(tmp_path, name, args, lines=4):
    """orb-md stopped by SIGTERM once the last structure's log has ``lines`` lines; exits 75."""
    process = subprocess.Popen([sys.executable, "scripts/md.py", "--checkpoint", V3, "--output", str(tmp_path / name),
                                "--device_target", "CPU", "--progress_bar", "false", *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / name / f"log_{len(ROWS) - 1}.csv"
    deadline = time.time() + 600
    while not (log.exists() and len(open(log).read().splitlines()) >= lines):
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 75, err[-2000:]


def same_files(tmp_path, a, b, rtol=1e-6, atol=1e-6):
    """Every structure's last frame (positions, cell) and log (every value) equal between two runs: the same steps,
    values to ``rtol`` (logs) and ``atol`` (Å)."""
    import ase.io

    for k in range(len(ROWS)):
        x, y = (ase.io.read(tmp_path / f / f"traj_{k}.extxyz", index=":") for f in (a, b))
        assert [f.info["step"] for f in x] == [f.info["step"] for f in y], k
        np.testing.assert_allclose(x[-1].positions, y[-1].positions, atol=atol, err_msg=f"structure {k}")
        np.testing.assert_allclose(x[-1].cell.array, y[-1].cell.array, atol=atol, err_msg=f"structure {k}")
        logs = [np.genfromtxt(tmp_path / f / f"log_{k}.csv", delimiter=",", names=True) for f in (a, b)]
        for column in logs[0].dtype.names:
            np.testing.assert_allclose(logs[0][column], logs[1][column], rtol=rtol, atol=1e-9, equal_nan=True,
                                       err_msg=f"structure {k}, {column}")


@pytest.mark.parametrize("ensemble", [["--ensemble", "npt", "--taup", "50", "--pressure", "10000"],
                                      ["--ensemble", "nvt", "--thermostat", "nose-hoover", "--tdamp", "20"]])
def test_fixed_atoms_resume_exactly_under_a_barostat_and_a_nose_hoover_chain(tmp_path, ensemble):
    """A structure with fixed atoms, stopped and resumed: the barostat moves fixed atoms with the cell (a resume
    put them back where the input had them: 0.017 Å off), and the Nose-Hoover chain keeps positions and momenta of
    its own (a resume lost them); both now end where the uninterrupted run ends."""
    import ase.io
    from ase.constraints import FixAtoms

    _, frames = start_frames(tmp_path)
    frames[2].set_constraint(FixAtoms([0, 1]))
    path = str(tmp_path / "fixed.extxyz")
    ase.io.write(path, frames, format="extxyz")
    common = ["--data", path, *ensemble, "--timestep", "1", "--steps", "40", "--write_every", "4", "--seed", "2"]
    assert orb_md(tmp_path, "straight", *common).returncode == 0
    run_and_stop(tmp_path, "stopped", common)
    assert max(json.load(open(tmp_path / "stopped" / f"state_{k}.json"))["step"] for k in range(len(ROWS))) < 40
    resumed = orb_md(tmp_path, "stopped", *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    fixed = ase.io.read(tmp_path / "stopped" / "traj_2.extxyz", index=-1)
    assert fixed.constraints and list(fixed.constraints[0].index) == [0, 1]
    same_files(tmp_path, "straight", "stopped")


def test_a_longer_resume_of_a_finished_run_is_the_longer_run(tmp_path):
    """A finished run extended with --resume and more --steps: the frame the shorter run wrote only because it
    ended (off the --write_every grid) is not kept, so the files equal a straight longer run's; a finished run
    resumed as it is keeps its energy drift; another --batch_size is refused (it changes the forces' last bits)."""
    path, _ = start_frames(tmp_path)
    common = ["--data", path, "--ensemble", "nve", "--timestep", "1", "--write_every", "3", "--seed", "1"]
    assert orb_md(tmp_path, "straight", *common, "--steps", "9").returncode == 0
    assert orb_md(tmp_path, "extended", *common, "--steps", "7").returncode == 0
    drift = [s["total_energy_drift_eV_per_atom"]
             for s in json.load(open(tmp_path / "extended" / "summary.json"))["structures"]]
    assert orb_md(tmp_path, "extended", *common, "--steps", "7", "--resume").returncode == 0
    assert [s["total_energy_drift_eV_per_atom"]
            for s in json.load(open(tmp_path / "extended" / "summary.json"))["structures"]] == drift
    assert all(d is not None for d in drift)
    import shutil  # the same run's states as the previous version wrote them: no record of the off-grid last frame

    shutil.copytree(tmp_path / "extended", tmp_path / "old")
    for k in range(3):
        state = json.load(open(tmp_path / "old" / f"state_{k}.json"))
        json.dump({key: v for key, v in state.items() if key != "last_frame_only"},
                  open(tmp_path / "old" / f"state_{k}.json", "w"))
    kept = {name: (tmp_path / "old" / name).read_bytes() for name in os.listdir(tmp_path / "old")}
    old = orb_md(tmp_path, "old", *common, "--steps", "9", "--resume")  # it kept the frame at step 7
    assert old.returncode == 2 and old.stderr.strip().splitlines() == [
        f"error: --resume {tmp_path / 'old'}: structure 0's run, written by an earlier version, ended at step 7, off "
        "the --write_every grid, and its state does not say where its files were before that frame: extend it with "
        "the version that wrote it, or start it again"], old.stderr[-2000:]
    assert {name: (tmp_path / "old" / name).read_bytes() for name in os.listdir(tmp_path / "old")} == kept
    refused = orb_md(tmp_path, "extended", *common, "--steps", "9", "--batch_size", "2", "--resume")
    assert refused.returncode == 2 and "batch_size: 32 -> 2" in refused.stderr, refused.stderr[-2000:]
    assert orb_md(tmp_path, "extended", *common, "--steps", "9", "--resume").returncode == 0
    # fewer steps than the run has taken: refused (finished structures kept 9 steps under a summary of 5)
    shrunk = orb_md(tmp_path, "extended", *common, "--steps", "5", "--resume")
    assert shrunk.returncode == 2 and "steps: 9 -> 5 (it may grow, not shrink)" in shrunk.stderr, shrunk.stderr
    same_files(tmp_path, "straight", "extended")
    straight, extended = (json.load(open(tmp_path / f / "summary.json"))["structures"] for f in ("straight", "extended"))
    for a, b in zip(straight, extended):
        assert b["total_energy_drift_eV_per_atom"] == pytest.approx(a["total_energy_drift_eV_per_atom"], abs=1e-9)


def test_a_boxed_crystal_without_pbc_is_periodic_to_orb_v2_and_to_its_frames(tmp_path):
    """orb-v2 reads a structure with a non-zero cell as periodic whatever its pbc (as orb-models 0.4.2): its frames
    carry the model's stress and its log a pressure and volume, as for pbc True (they were dropped: NaN pressure,
    no stress, for the model's own periodic prediction)."""
    import ase.io

    from orb.inference.calculator import ORBCalculator

    path, frames = start_frames(tmp_path)
    boxed = frames[0].copy()
    boxed.pbc = False
    ase.io.write(tmp_path / "boxed.extxyz", [boxed], format="extxyz")
    v2 = os.path.join(ROOT, "data", "demo_pretrained.ckpt")
    result = subprocess.run([sys.executable, "scripts/md.py", "--checkpoint", v2, "--output", str(tmp_path / "md"),
                             "--device_target", "CPU", "--progress_bar", "false", "--data",
                             str(tmp_path / "boxed.extxyz"), "--ensemble", "nve", "--timestep", "1", "--steps", "0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    frame = ase.io.read(tmp_path / "md" / "traj_0.extxyz")
    boxed.calc = ORBCalculator.from_checkpoint(v2, device_target="CPU")
    np.testing.assert_allclose(frame.calc.results["stress"], boxed.get_stress(), atol=1e-6)
    log = (tmp_path / "md" / "log_0.csv").read_text().splitlines()
    row = dict(zip(log[0].split(","), log[1].split(",")))
    assert np.isfinite(float(row["pressure_GPa"])) and float(row["volume_A3"]) == pytest.approx(boxed.get_volume())


def test_a_nose_hoover_chain_whose_state_cannot_be_saved_is_refused():
    """orb-md saves the chain's own positions, momenta and thermostat from ASE's attributes (3.29); an integrator
    without them (a later ASE naming them otherwise: here a Verlet integrator stands in) is refused in one line,
    where it would have been resumed inexactly without a word."""
    from ase.build import bulk
    from ase.md.nose_hoover_chain import NoseHooverChainNVT
    from ase.md.verlet import VelocityVerlet

    from orb.errors import OrbInputError
    from orb.inference.md import check_chain_state

    atoms = bulk("Cu", cubic=True)
    check_chain_state(NoseHooverChainNVT(atoms, timestep=1.0, temperature_K=300, tdamp=100.0))
    with pytest.raises(OrbInputError, match="keeps the chain's state where orb-md cannot save it"):
        check_chain_state(VelocityVerlet(atoms, timestep=1.0))


def test_a_full_disk_is_one_line_and_a_resume_with_space_ends_as_the_uninterrupted_run(tmp_path, small_disk):
    """The output on a disk that fills up (a 64 kB tmpfs): one line naming the fault and --resume, exit 1 (a raw
    OSError traceback from the summary's write); with space again, --resume ends equal to an uninterrupted run."""
    import shutil

    path, _ = start_frames(tmp_path)
    args = ("--data", path, "--timestep", "1", "--steps", "40", "--write_every", "1", "--ensemble", "nve")
    disk = small_disk(64 * 1024)
    full = subprocess.run([sys.executable, "scripts/md.py", "--checkpoint", V3, "--output", str(disk / "md"),
                           "--device_target", "CPU", "--progress_bar", "false", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    lines = full.stderr.strip().splitlines()
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert "No space left on device" in lines[-1] and "--resume" in lines[-1], lines
    shutil.copytree(disk / "md", tmp_path / "moved")
    resumed = orb_md(tmp_path, "moved", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = orb_md(tmp_path, "straight", *args)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # the disk fails structure by structure, each at the step its own write failed (which one first is the
    # threads' timing): the resume's batches then differ from the uninterrupted run's (a structure's last steps
    # alone), and so do the forces' float32 last bits (seen: 1.1e-6 of a pressure after 40 steps)
    same_files(tmp_path, "moved", "straight", rtol=2e-5, atol=2e-5)
