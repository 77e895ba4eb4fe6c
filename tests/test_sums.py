"""Sums that do not grow an error with the structure (orb.models.sums, docs/numerics.md).

An n-fold supercell's energy is n times its cell's, and a structure's energy does not depend on the order of its
atoms, to the float32 rounding of the total (a few ulps of |E|), at ~1,000 and ~8,000 atoms, for orb-v2 and orb-v3
(direct and conservative). The reference energies are the published "vasp-shifted" table (about -5.1 eV per Cu
atom), which sets the size of the sum. The architecture is reduced (the sums do not depend on depth or width) and
compared with itself in float64; a full-size orb-v2 on ~1,000 atoms is compared with PyTorch orb-models (float32
and float64). The sum primitive is checked in both of its forms (float64 accumulation, and the exact grid split
that Ascend runs), and a model in the split form.
"""

import os
import subprocess

import numpy as np
import pytest

from conftest import ROOT

TINY = dict(latent_dim=16, mlp_hidden_dim=32, num_mlp_layers=1, num_message_passing_steps=1, head_mlp_hidden_dim=16,
            num_rbf=4)
FAMILIES = ("orb_v2", "orb_v3_direct_20_omat", "orb_v3_conservative_20_omat")
ULPS = 3  # allowed |E(supercell) - n E(cell)| and |E(permuted) - E|, in float32 ulps of |E|


def ulp(value) -> float:
    return float(np.spacing(np.float32(np.abs(value).max())))


def alloy_cell():
    """16 atoms of hcp Cu with every fourth atom Au, rattled (no neighbours tied at the cap of 20)."""
    from ase.build import bulk

    cell = bulk("Cu", "hcp", a=2.56, c=4.17).repeat((2, 2, 2))
    cell.numbers[::4] = 79
    cell.rattle(0.05, seed=1)
    return cell


def wrapped(atoms):
    """``atoms`` with positions wrapped into the cell in float64 (orb-models and we then build the same graph)."""
    from orb.data.graphs import wrap_positions64

    atoms = atoms.copy()
    atoms.positions = wrap_positions64(atoms.positions, atoms.cell.array)
    return atoms


def predict(calculator, atoms):
    atoms = atoms.copy()
    atoms.calc = calculator
    return atoms.get_potential_energy(), atoms.get_stress()


def small_calculator(name, configure=True):
    """A calculator of model ``name`` with the reduced architecture (random weights, the published reference
    energies); ``configure``: on the CPU first (which sets the sums' form for the CPU)."""
    from orb.device import configure_mindspore
    from orb.inference.calculator import ORBCalculator
    from orb.models import create

    if configure:
        configure_mindspore("CPU")
    model = create(name, **TINY)
    model.set_train(False)
    return ORBCalculator(model)


@pytest.mark.parametrize("repeat", [4, 8], ids=["1024_atoms", "8192_atoms"])
@pytest.mark.parametrize("name", FAMILIES)
def test_supercell_energy_is_n_times_the_cell_s(name, repeat):
    """E(n-fold supercell) = n E(cell) within a few float32 ulps of the total (before, with the reference energies
    summed atom by atom and the latents' mean in float32: 11-21 ulps off at 1,024 atoms, 700-770 (2.7-3.0 eV) at
    8,192)."""
    calculator = small_calculator(name)
    cell = alloy_cell()
    big = cell.repeat((repeat,) * 3)
    e_cell, energy = predict(calculator, cell)[0], predict(calculator, big)[0]
    n = len(big) // len(cell)
    assert abs(energy - n * e_cell) <= ULPS * ulp(energy), (energy - n * e_cell, ulp(energy))


@pytest.mark.parametrize("name", FAMILIES)
def test_energy_and_stress_do_not_depend_on_the_order_of_the_atoms(name):
    """8,192 atoms listed at random and with all Cu first: energy and stress within a few float32 ulps of those in
    the original order (before, Cu first: the energy moved by 660-710 ulps, 2.6-2.8 eV, the stress by 150-200)."""
    calculator = small_calculator(name)
    big = alloy_cell().repeat((8, 8, 8))
    energy, stress = predict(calculator, big)
    for order in (np.random.default_rng(0).permutation(len(big)), np.argsort(big.numbers, kind="stable")):
        e_order, s_order = predict(calculator, big[order])
        assert abs(e_order - energy) <= ULPS * ulp(energy), (e_order - energy, ulp(energy))
        np.testing.assert_allclose(s_order, stress, rtol=0, atol=ULPS * ulp(stress))


def test_ascend_form_of_the_sums_keeps_the_supercell_energy():
    """The grid split Ascend runs (forced here on the CPU): the same bound at 8,192 atoms."""
    from orb.device import configure_mindspore
    from orb.precision import set_sum_form

    configure_mindspore("CPU")
    set_sum_form("split")
    try:
        calculator = small_calculator("orb_v2", configure=False)
        assert calculator.model.sum_form == "split"
        cell = alloy_cell()
        big = cell.repeat((8, 8, 8))
        e_cell, energy = predict(calculator, cell)[0], predict(calculator, big)[0]
        e_order = predict(calculator, big[np.argsort(big.numbers, kind="stable")])[0]
    finally:
        set_sum_form("float64")
    assert abs(energy - 512 * e_cell) <= ULPS * ulp(energy), (energy - 512 * e_cell, ulp(energy))
    assert abs(e_order - energy) <= ULPS * ulp(energy), (e_order - energy, ulp(energy))


def weighted_totals(ids):
    """x -> sum of its segment totals weighted by 0..11 (the gradient gives each row its segment's weights)."""
    from mindspore import Tensor, nn

    from orb.models import sums

    class Cell(nn.Cell):
        def __init__(self):
            super().__init__()
            self.ids, self.weights = Tensor(ids), Tensor(np.arange(12.0, dtype=np.float32).reshape(4, 3))

        def construct(self, x):
            return (sums.segment_total(x, self.ids, 4) * self.weights).sum()

    return Cell()


@pytest.mark.parametrize("form", ["float64", "split"])
def test_segment_total_is_the_exact_sum_rounded_once_in_any_order(form):
    """Sums of 10,000 float32 values per segment (mixed magnitudes and signs, cancellation, one segment of zeros)
    against the exact float64 sum, and under a permutation of the rows; the gradient is the plain sum's."""
    import mindspore as ms
    from mindspore import Tensor

    from orb.models import sums
    from orb.precision import set_sum_form

    rng = np.random.default_rng(3)
    rows = 10_000
    ids = np.sort(rng.integers(0, 3, rows)).astype(np.int32)
    ids[ids == 2] = 3  # segment 2 empty
    data = np.stack([-5.1 + 0.01 * rng.standard_normal(rows),  # a reference-energy-like column
                     rng.standard_normal(rows) * np.exp(rng.uniform(-8, 3, rows)),  # mixed magnitudes
                     np.where(np.arange(rows) % 2, 1.0, -1.0) * 3.3 + 1e-4 * rng.standard_normal(rows)], 1)
    data = data.astype(np.float32)
    exact = np.zeros((4, 3))
    np.add.at(exact, ids, data.astype(np.float64))
    set_sum_form(form)
    try:
        ms.set_context(mode=ms.GRAPH_MODE)
        got = sums.segment_total(Tensor(data), Tensor(ids), 4).asnumpy()
        order = rng.permutation(rows)
        again = sums.segment_total(Tensor(data[order]), Tensor(ids[order]), 4).asnumpy()
        grad = ms.grad(weighted_totals(ids))(Tensor(data))
    finally:
        set_sum_form("float64")
    np.testing.assert_array_equal(got[2], 0.0)
    error = np.abs(got - exact) / np.spacing(np.abs(exact).astype(np.float32))  # in ulps of each result
    assert error.max() <= 1.0, error
    again_error = np.abs(again - exact) / np.spacing(np.abs(exact).astype(np.float32))
    assert again_error.max() <= 1.0, again_error
    if form == "float64":  # one rounding of a float64 sum: the same bits in any order
        np.testing.assert_array_equal(again, got)
    np.testing.assert_array_equal(grad.asnumpy(), np.arange(12.0).reshape(4, 3)[ids])
    plain = np.zeros((4, 3), np.float32)
    for i, row in zip(ids, data):  # what one float32 accumulator gives: far off (the test would see it)
        plain[i] += row
    assert np.abs(plain - exact).max() > 4 * np.spacing(np.float32(np.abs(exact).max()))


@pytest.mark.parametrize("name", FAMILIES)
def test_float32_error_of_1024_atoms_is_64_times_its_cell_s(name):
    """Against the same model in float64 (exact sums): float32's error on 1,024 atoms is 64 times its error on their
    16-atom cell, to a few float32 ulps of the total -- only the network's own per-atom float32 rounding remains,
    which does not grow with the structure (2e-6 eV/atom in this orb-v3, 4.6 ulps of every total). Before: 11-15
    ulps more."""
    calculator = small_calculator(name)
    exact = type(calculator)(calculator.model, precision="float64")
    cell = alloy_cell()
    big = cell.repeat((4, 4, 4))
    error_cell = predict(calculator, cell)[0] - predict(exact, cell)[0]
    energy64 = predict(exact, big)[0]
    error = predict(calculator, big)[0] - energy64
    assert abs(error - 64 * error_cell) <= ULPS * ulp(energy64), (error, 64 * error_cell, ulp(energy64))


# 1.7 GB above the start (PyTorch's float64 full-size orb-v2 on 1,024 atoms, then ours): with the two workers' 2 GB
# each late in the run and another test, over CI's 6 GB
@pytest.mark.alone
def test_1024_atoms_agree_with_pytorch_orb_models(tmp_path):
    """Full-size orb-v2 (random weights; orb-models builds its full size), 1,024 atoms of CuAu: our float32 energy is
    within a few float32 ulps of the total of orb-models' float64 one (0.4.2, the PyTorch peer; our own full-size
    float64 takes over 8 GB at this size: the comparison with it above is reduced), and of orb-models' float32 one,
    whose mean over atoms is a float32 sum (itself 2-11 ulps from its float64 here, by torch's threads): ours is
    never further from it than that plus 4 ulps. Before: 13 ulps from the float64 total."""
    peer = os.environ.get("ORB_TORCH_PYTHON", "")
    if not peer:
        pytest.skip("ORB_TORCH_PYTHON (a python with torch and orb-models 0.4.2) is not set; .ci/run sets it")
    from orb.device import configure_mindspore
    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import to_torch_state_dict
    from orb.io.torch_format import write_torch_checkpoint
    from orb.models import create

    configure_mindspore("CPU")
    big = wrapped(alloy_cell().repeat((4, 4, 4)))
    model = create("orb_v2", seed=5)
    model.set_train(False)
    path = str(tmp_path / "weights.ckpt")
    write_torch_checkpoint(to_torch_state_dict(model), path)
    np.savez(tmp_path / "structures.npz", names=np.array(["big"]), **{"big/numbers": big.numbers,
                                                                      "big/positions": big.positions,
                                                                      "big/cell": big.cell.array})
    theirs = {}
    for precision in ("float32-highest", "float64"):
        result = subprocess.run([peer, os.path.join(ROOT, "tests", "torch_peer.py"), "orb_v2", path,
                                 str(tmp_path / "structures.npz"), str(tmp_path / "torch.npz"), precision],
                                capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0, result.stderr[-3000:]
        theirs[precision] = float(np.load(tmp_path / "torch.npz")["big/energy"][0])
    ours = predict(ORBCalculator(model), big)[0]
    exact = theirs["float64"]
    assert abs(ours - exact) <= 4 * ulp(exact), (ours - exact, ulp(exact))
    # orb-models' float32 energy carries its own summation error, which depends on torch's threads (2 to 11 ulps
    # seen): ours is never further from it than that error plus our 4 ulps
    their_error = abs(theirs["float32-highest"] - exact)
    assert abs(ours - theirs["float32-highest"]) <= their_error + 4 * ulp(exact), (ours, theirs, ulp(exact))


@pytest.mark.parametrize("form", ["float64", "split"])
def test_the_normalisers_running_statistics_do_not_drift_over_many_steps(form):
    """The normalisers' statistics are a mean over every training step. Updated as (1 - f) mean + f batch_mean in
    float32, ``1 - f`` rounded near 1 moved a mean counted over 2e7 batches by one float32 step per batch, even for
    batches equal to it (0.5 eV/atom per million steps). Now mean + f (batch_mean - mean), in float64 where the
    device has it (``float64`` form) and in float32 on Ascend (``split``): batches equal to the mean leave it, and
    100 random batches at a count of 3e6 end within a few float32 steps of the float64 cumulative mean."""
    import mindspore as ms

    from orb.models.gns import ScalarNormalizer
    from orb.precision import set_sum_form

    set_sum_form(form)
    try:
        steady = ScalarNormalizer(4.29, 0.3, count=20_000_000)
        walking = ScalarNormalizer(4.29, 0.3, count=3_000_000)
    finally:
        set_sum_form("float64")
    before = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)  # (op by op: the update's arithmetic as a compiled step runs it)
    try:
        steady_means, walking_mean, exact = run_normalisers(steady, walking)
    finally:
        ms.set_context(mode=before)
    assert steady_means == {4.289999961853027}
    assert abs(walking_mean - exact) <= 8 * np.spacing(np.float32(4.29)), (walking_mean - exact)


def run_normalisers(steady, walking):
    """20 batches equal to ``steady``'s mean, and 100 random ones into ``walking``: steady's means after each, walking's
    mean at the end, and the float64 cumulative mean of walking's batches."""
    from mindspore import Tensor

    def step(normalizer, values):
        values = np.asarray(values, np.float32)
        sums = normalizer.batch_sums(Tensor(values), Tensor(np.ones(values.shape, np.float32)))
        normalizer.commit(*normalizer.updated_stats(sums))

    def mean_of(normalizer) -> float:
        return float(normalizer.stats()[0].asnumpy()[0])

    steady_means = set()
    for _ in range(20):
        step(steady, [mean_of(steady)] * 8)
        steady_means.add(mean_of(steady))
    rng = np.random.default_rng(5)
    exact, count = float(np.float32(4.29)), 3_000_000
    for _ in range(100):
        batch = rng.normal(4.29, 0.3, 16).astype(np.float32)
        step(walking, batch)
        count += 1
        exact += (float(batch.astype(np.float64).mean()) - exact) / count
    return steady_means, mean_of(walking), exact
