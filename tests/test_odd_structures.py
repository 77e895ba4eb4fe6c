"""Odd but valid structures in the use commands: every structure the input formats hold is either handled correctly by
orb-md, orb-relax (with and without --cell), orb-evaluate and the ASE calculator -- finite results equal to ASE's own
integrator or FIRE driving ORBCalculator structure by structure, the same energy for the same crystal in another
basis -- or refused before any work in one line naming the file, the frame and the cause, nothing written. A NaN
the code makes itself is never blamed on the structure.

Table: structures (each written to its own extxyz file) x models (orb-v2 and orb-v3 demos) x entry points.

Found before (main at 252e4ef): a one-atom primitive cell (Materials Project's elemental metals) failed every orb-md
ensemble with "positions contain NaN or inf" (ASE's Stationary rescaled a kinetic energy of 0 by 0); orb-relax
--cell on a molecule stored with pbc and no cell ended in a traceback (PropertyNotImplementedError: stress); the
calculator gave a molecule orb-v2's meaningless stress; orb-v3's pbc on two axes only was found per structure
mid-run (orb-md, orb-relax: exit 1 after the others ran); a molecule without pbc in a degenerate box (ASE's
center(vacuum=0) of a flat molecule) was refused for orb-v3, which ignores its cell; orb-v3 graphs of a skewed
cell lost 43 % of their neighbours (another energy for the same crystal).
"""

import csv
import os

import numpy as np
import pytest

from conftest import ROOT

MODELS = {"orb_v2": os.path.join(ROOT, "data", "demo_pretrained.ckpt"),
          "orb_v3": os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")}
COMMON = ["--device_target", "CPU", "--progress_bar", "false"]
STEPS = 4


def water(pbc=False):
    from ase.build import molecule

    atoms = molecule("H2O")
    atoms.pbc = pbc
    return atoms


def cubic_copper(seed=1):
    from ase.build import bulk

    atoms = bulk("Cu", cubic=True)
    atoms.rattle(0.05, seed=seed)
    return atoms


def skewed_iron(reduced=False):
    """A triclinic 2-atom Fe cell (its 20th and 21st neighbours 0.29 Å apart: no tie at the neighbour cap decides
    its graph) in a Niggli-unreduced basis (a2 + 6 a1): the same crystal as the reduced one."""
    from ase import Atoms

    cell = np.array([[2.741, 0.313, -0.039], [0.41, 3.291, 0.105], [0.271, 0.028, 3.033]])
    atoms = Atoms("Fe2", scaled_positions=[[0, 0, 0], [0.692, 0.574, 0.56]], cell=cell, pbc=True)
    if not reduced:
        skewed = cell.copy()
        skewed[1] += 6 * cell[0]
        atoms.set_cell(skewed, scale_atoms=False)
    return atoms


def one_atom():
    from ase.build import bulk

    atoms = bulk("Cu")  # the fcc primitive cell, as Materials Project stores elemental metals
    atoms.set_cell(atoms.cell.array * 1.02, scale_atoms=True)
    return atoms


def short_vector():
    from ase import Atoms

    return Atoms("Cu2", positions=[[0, 0, 0], [1.2, 1.9, 1.6]], cell=[[2.4, 0, 0], [0, 7.0, 0], [0, 0, 7.0]], pbc=True)


def slab():
    from ase.build import fcc111

    atoms = fcc111("Cu", size=(2, 2, 3), vacuum=5.0)
    atoms.pbc = [True, True, False]
    atoms.rattle(0.03, seed=3)
    atoms.info.clear()
    return atoms


def flat_molecule_in_a_degenerate_box():
    atoms = water()
    atoms.center(vacuum=0.0)  # a planar molecule: one cell length 0, pbc False
    return atoms


def lone_atom():
    from ase import Atoms

    return Atoms("Ar", positions=[[0.0, 0.0, 0.0]])


def fixed_crystal():
    from ase.constraints import FixAtoms

    atoms = cubic_copper(seed=4)
    atoms.set_constraint(FixAtoms(indices=range(len(atoms))))
    return atoms


def left_handed(right=False):
    atoms = cubic_copper(seed=5)
    if not right:
        atoms.set_cell(atoms.cell.array[[1, 0, 2]], scale_atoms=False)
    return atoms


STRUCTURES = {
    "molecule_with_pbc_and_no_cell": lambda: [water(pbc=True)],
    "one_atom_primitive_cell": lambda: [one_atom()],
    "molecules_and_crystals_mixed": lambda: [water(), cubic_copper(), one_atom(), water(pbc=True)],
    "skewed_cell": lambda: [skewed_iron()],
    "two_atoms_short_vector": lambda: [short_vector()],
    "slab_periodic_in_two_axes": lambda: [slab()],
    "flat_molecule_in_a_degenerate_box": lambda: [flat_molecule_in_a_degenerate_box()],
    "lone_atom": lambda: [lone_atom()],
    "every_atom_fixed": lambda: [fixed_crystal()],
    "left_handed_cell": lambda: [left_handed()],
}
# refused before any work: (model, structure) -> (key, cause); every other pair is handled
REFUSED = {("orb_v3", "slab_periodic_in_two_axes"): ("pbc", "periodic along some axes only"),
           ("orb_v2", "flat_molecule_in_a_degenerate_box"): ("cell", "store a molecule with a zero cell")}
# the same crystal in another basis: the same energy (orb-v2 searches neighbours among the 27 cells around the home
# cell only, as orb-models 0.4.2 defines its graph and trained it: a skewed basis gives it another graph, by design)
SAME_CRYSTAL = {("orb_v3", "skewed_cell"): lambda: skewed_iron(reduced=True),
                ("orb_v2", "left_handed_cell"): lambda: left_handed(right=True),
                ("orb_v3", "left_handed_cell"): lambda: left_handed(right=True)}


@pytest.fixture(scope="module")
def calculators():
    from orb.inference.calculator import ORBCalculator

    return {name: ORBCalculator.from_checkpoint(path, device_target="CPU") for name, path in MODELS.items()}


def sees_periodic(atoms, family):
    return bool(atoms.cell.any() and (atoms.pbc.all() if family == "orb_v3" else True))


def run_main(main, capsys, argv):
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err.strip().splitlines()


def fire(atoms, calculator, cell, family, steps=STEPS):
    """ASE's FIRE driving ORBCalculator, on the filter orb-relax chooses: (energy, steps, converged)."""
    from ase.filters import FrechetCellFilter
    from ase.optimize import FIRE

    atoms = atoms.copy()
    atoms.calc = calculator
    target = atoms
    if cell and atoms.pbc.any() and sees_periodic(atoms, family):
        target = FrechetCellFilter(atoms, mask=None if atoms.pbc.all() else np.outer(atoms.pbc, atoms.pbc))
    optimizer = FIRE(target, logfile=None)
    converged = optimizer.run(fmax=0.05, steps=steps)
    return atoms.get_potential_energy(), optimizer.nsteps, converged, atoms


@pytest.mark.parametrize("name", list(STRUCTURES))
@pytest.mark.parametrize("family", list(MODELS))
def test_each_entry_point_handles_or_refuses_the_structure(tmp_path, monkeypatch, capsys, calculators, family, name):
    import ase.db
    import ase.io

    from orb.errors import OrbInputError
    from orb.inference import evaluate, md, relax

    frames = STRUCTURES[name]()
    path = str(tmp_path / f"{name}.extxyz")
    ase.io.write(path, frames, format="extxyz")
    checkpoint, calculator = MODELS[family], calculators[family]
    runs = {
        "md": (md.main, ["--checkpoint", checkpoint, "--data", path, "--output", tmp_path / "md", "--ensemble", "nve",
                         "--timestep", "1", "--steps", STEPS, "--write_every", "1", *COMMON], tmp_path / "md"),
        "relax": (relax.main, ["--checkpoint", checkpoint, "--data", path, "--output", tmp_path / "relaxed.db",
                               "--steps", STEPS, *COMMON], tmp_path / "relaxed.db"),
        "relax --cell": (relax.main, ["--checkpoint", checkpoint, "--data", path, "--output", tmp_path / "cell.db",
                                      "--steps", STEPS, "--cell", *COMMON], tmp_path / "cell.db"),
        "evaluate": (evaluate.main, ["--checkpoint", checkpoint, "--data", path, "--output_dir", tmp_path / "eval",
                                     *COMMON], tmp_path / "eval")}
    if (family, name) in REFUSED:
        key, cause = REFUSED[(family, name)]
        for command, (main, argv, output) in runs.items():
            status, lines = run_main(main, capsys, argv)
            assert status == 2 and len(lines) == 1, (command, lines)
            assert lines[0].startswith(f"error: {path}, frame 0, key '{key}': ") and cause in lines[0], (command, lines)
            assert not os.path.exists(output), command  # refused before any work: nothing written
        atoms = frames[0].copy()
        atoms.calc = calculator
        with pytest.raises(OrbInputError, match=cause):
            atoms.get_potential_energy()
        return

    # the calculator: finite energy and forces; stress exactly where the model sees a periodic structure
    energies = []
    for atoms in frames:
        atoms = atoms.copy()
        atoms.calc = calculator
        energies.append(atoms.get_potential_energy())
        assert np.isfinite(energies[-1]) and np.all(np.isfinite(atoms.get_forces()))
        if sees_periodic(atoms, family):
            assert np.all(np.isfinite(atoms.get_stress()))
        else:
            from ase.calculators.calculator import PropertyNotImplementedError

            with pytest.raises(PropertyNotImplementedError):
                atoms.get_stress()
    if (family, name) in SAME_CRYSTAL:
        same = SAME_CRYSTAL[(family, name)]()
        same.calc = calculator
        assert same.get_potential_energy() == pytest.approx(energies[0], abs=2e-4)

    # orb-evaluate: the calculator's energies
    status, lines = run_main(runs["evaluate"][0], capsys, runs["evaluate"][1])
    assert status == 0, lines
    with open(tmp_path / "eval" / "predictions.csv") as f:
        predicted = [float(row["energy_pred"]) for row in csv.DictReader(f)]
    np.testing.assert_allclose(predicted, energies, atol=2e-4)

    # orb-relax, with and without --cell: ASE's FIRE on ORBCalculator, structure by structure
    for command, cell in (("relax", False), ("relax --cell", True)):
        main, argv, output = runs[command]
        status, lines = run_main(main, capsys, argv)
        assert status == 0 and not any("stopped" in line for line in lines), (command, lines)
        with ase.db.connect(str(output)) as db:
            rows = {row.source_row: row for row in db.select()}
        assert sorted(rows) == list(range(1, len(frames) + 1)), command
        for k, atoms in enumerate(frames):
            energy, steps, converged, relaxed = fire(atoms, calculator, cell, family)
            row = rows[k + 1]
            assert (row.relax_steps, row.converged) == (steps, converged), (command, k)
            assert row.energy == pytest.approx(energy, abs=2e-4), (command, k)
            np.testing.assert_allclose(row.cell, relaxed.cell.array, atol=1e-5, err_msg=f"{command} {k}")
            assert ("stress" in row) == sees_periodic(atoms, family), (command, k)

    # orb-md (NVE): ASE's VelocityVerlet on ORBCalculator from the same first frame; a structure at rest is said
    from ase import units
    from ase.md.verlet import VelocityVerlet

    main, argv, output = runs["md"]
    status, lines = run_main(main, capsys, argv)
    assert status == 0, lines
    at_rest = [k for k, atoms in enumerate(frames) if len(atoms) == 1 or atoms.constraints]
    notes = [line for line in lines if line.startswith("note:")]
    assert notes == ([f"note: {len(at_rest)} structure(s) (structure {at_rest[0]}, {path}, frame {at_rest[0]}"
                      f"{' ...' if len(at_rest) > 1 else ''}) have no motion but their centre of mass's (one atom, or "
                      "every atom fixed), which orb-md removes: they start at rest"] if at_rest else []), lines
    for k, atoms in enumerate(frames):
        trajectory = ase.io.read(output / f"traj_{k}.extxyz", index=":")
        assert [f.info["step"] for f in trajectory] == list(range(STEPS + 1))
        start = atoms.copy()
        start.set_positions(trajectory[0].positions, apply_constraint=False)
        start.set_momenta(trajectory[0].get_momenta(), apply_constraint=False)
        start.calc = calculator
        VelocityVerlet(start, timestep=1 * units.fs).run(STEPS)
        np.testing.assert_allclose(trajectory[-1].positions, start.positions, atol=1e-5, err_msg=f"structure {k}")
        log = np.genfromtxt(output / f"log_{k}.csv", delimiter=",", names=True)
        for column in ("temperature_K", "potential_eV", "kinetic_eV", "total_eV"):
            assert np.all(np.isfinite(log[column])), (k, column)
        if k in at_rest:
            assert not np.any(trajectory[0].get_momenta()), k


@pytest.mark.parametrize("ensemble", [["--ensemble", "npt"], ["--ensemble", "nvt", "--thermostat", "nose-hoover"],
                                      ["--ensemble", "nvt"]])
def test_one_atom_runs_in_every_ensemble(tmp_path, monkeypatch, capsys, ensemble):
    """A one-atom cell (at rest: its only motion is its centre of mass's) in each thermostat and barostat: finite
    steps, no structure blamed (Berendsen divides by its temperature, 0: ASE clips the scaling)."""
    import ase.io

    from orb.inference import md

    path = str(tmp_path / "one.extxyz")
    ase.io.write(path, [one_atom(), cubic_copper()], format="extxyz")
    status, lines = run_main(md.main, capsys, ["--checkpoint", MODELS["orb_v3"], "--data", path, "--output",
                                               tmp_path / "md", "--timestep", "1", "--steps", STEPS, *ensemble,
                                               *COMMON])
    assert status == 0 and not any("stopped" in line or "Warning" in line for line in lines), lines
    for k in range(2):
        log = np.genfromtxt(tmp_path / "md" / f"log_{k}.csv", delimiter=",", names=True)
        assert len(log) == 1 or all(np.all(np.isfinite(log[c])) for c in ("temperature_K", "total_eV", "volume_A3"))
        frame = ase.io.read(tmp_path / "md" / f"traj_{k}.extxyz", index=-1)
        assert frame.info["step"] == STEPS and np.all(np.isfinite(frame.positions))
