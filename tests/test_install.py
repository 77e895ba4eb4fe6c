"""The installed package: ``pip install`` into a fresh environment, then the console commands and the
calculator from a folder outside the checkout."""

import os
import subprocess
import sys
import sysconfig

from conftest import DATA, ROOT, SMALL_MODEL


def test_pip_install_and_run_outside_the_checkout(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (MindSpore, ...) come from this environment; the package itself is installed for real
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              ROOT], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH="")
    where = subprocess.run([str(python), "-c", "import orb, finetune; print(orb.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0 and site in where.stdout, where.stderr[-2000:]  # not the checkout's copy
    for command in ("orb-finetune", "orb-finetune-parallel", "orb-evaluate", "orb-convert", "orb-plot"):
        result = subprocess.run([str(venv / "bin" / command), "--help"], cwd=work, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and "usage" in result.stdout.lower() + result.stderr.lower(), command
    model = " ".join(f"--model.{k} {v}" for k, v in SMALL_MODEL.items()).split()
    run = subprocess.run([str(venv / "bin" / "orb-finetune"), "--config", os.path.join(ROOT, "configs", "demo.yaml"),
                          "--train_data_path", os.path.join(DATA, "10_mptraj_systems.db"), "--val_data_path", "",
                          "--checkpoint_path", "", "--max_epochs", "1", "--batch_size", "5", "--num_buckets", "1",
                          "--output_dir", "run", "--device_target", "CPU", *model],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (work / "run" / "checkpoints" / "last.ckpt").exists()  # relative to where it was run
    snippet = ("from orb.inference.calculator import ORBCalculator\n"
               "from ase.build import bulk\n"
               "atoms = bulk('Cu', 'fcc', a=3.6)\n"
               "atoms.calc = ORBCalculator.from_checkpoint('run/checkpoints/last.ckpt', device_target='CPU')\n"
               "print('energy', atoms.get_potential_energy())\n"
               "from orb.data.neighbours import native_search\n"
               "print('native neighbour search', native_search() is not None)\n")
    calc = subprocess.run([str(python), "-c", snippet], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert calc.returncode == 0 and "energy" in calc.stdout, calc.stderr[-2000:]
    assert "native neighbour search True" in calc.stdout  # its C++ source is installed with the package
