"""The installed package: ``pip install`` into a fresh environment, then the console commands and the
calculator from a folder outside the checkout."""

import os
import subprocess
import sys
import sysconfig

from conftest import ROOT


def installed(tmp_path, *how):
    """A fresh environment with the package installed (``how``: pip's options, ``-e`` for an editable install): its
    folder, its python and its site-packages. The dependencies (MindSpore, ...) come from this environment; the
    package itself is installed for real."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              *how, ROOT], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    return venv, python, site


def test_pip_install_and_run_outside_the_checkout(tmp_path):
    venv, python, site = installed(tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH="")
    where = subprocess.run([str(python), "-c", "import orb, finetune; print(orb.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0 and site in where.stdout, where.stderr[-2000:]  # not the checkout's copy
    from orb import __version__
    from orb.commands import COMMANDS

    package = subprocess.run([str(python), "-c", "from importlib import metadata; print(metadata.version("
                              "'orb-mindspore'), metadata.version('mindspore'))"], cwd=work, env=env,
                             capture_output=True, text=True).stdout.split()
    assert package[0] == __version__  # (pyproject.toml reads orb.__version__)
    installed_versions = f"orb-mindspore {__version__} (MindSpore {package[1]})"
    for command in COMMANDS:  # each says its name, its defaults and its version
        result = subprocess.run([str(venv / "bin" / command), "--help"], cwd=work, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: {command} "), (command, result.stderr)
        assert "(default: " in result.stdout, command
        version = subprocess.run([str(venv / "bin" / command), "--version"], cwd=work, env=env, capture_output=True,
                                 text=True, timeout=120)  # (the one line a user pastes into an issue)
        assert version.returncode == 0 and version.stdout == f"{command}: {installed_versions}\n", version.stderr
    # a finetune.py of the user's on the path (PYTHONPATH=.) replaced the command's own: an ImportError traceback
    (work / "finetune.py").write_text("print('a script of the user')\n")
    (work / "finetune_parallel.py").write_text("raise SystemExit('a script of the user')\n")
    shadowed = dict(env, PYTHONPATH=str(work))
    helped = subprocess.run([str(venv / "bin" / "orb-finetune"), "--help"], cwd=work, env=shadowed,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: orb-finetune "), helped.stderr[-2000:]
    worker = subprocess.run([str(python), "-c", "from orb.training.launch import worker_script; print(worker_script())"],
                            cwd=work, env=shadowed, capture_output=True, text=True, timeout=120)
    assert worker.stdout.strip().startswith(site + os.sep), worker.stdout + worker.stderr  # the installed one
    for name in ("finetune.py", "finetune_parallel.py"):
        (work / name).unlink()

    def finetune(*args):
        return subprocess.run([str(venv / "bin" / "orb-finetune"), *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)

    bundle = os.path.join(site, "orb", "_bundle")
    missing = finetune()  # no silent configs/config.yaml of the working folder: the templates, in one line
    assert missing.returncode == 2 and missing.stderr.startswith("error: no --config: name your YAML config file or "
                                                                 "a packaged template (packaged templates: ")
    assert "finetune_orb_v3" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    printed = finetune("--print-config", "finetune_orb_v3")
    assert printed.returncode == 0 and printed.stdout == open(os.path.join(bundle, "configs", "finetune_orb_v3.yaml"),
                                                              encoding="utf-8").read()
    demo = finetune("--print-config", "demo").stdout  # the bundled demo data's paths made absolute: it runs anywhere
    assert f"train_data_path: {os.path.join(bundle, 'data', 'demo_train.db')}\n" in demo
    assert f"checkpoint_path: {os.path.join(bundle, 'data', 'demo_pretrained.ckpt')}\n" in demo
    run = finetune("--config", "demo", "--max_epochs", "1", "--num_buckets", "1", "--output_dir", "run",
                   "--device_target", "CPU", "--progress_bar", "false")  # the packaged demo: its data and weights
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (work / "run" / "checkpoints" / "last.ckpt").exists()  # output_dir relative to where it was run
    log = (work / "run" / "train.log").read_text()
    assert os.path.join(bundle, "data", "demo_train.db") in log
    smoke = subprocess.run([str(python), "-c", "import os, orb.smoke_test as s; "
                            "print(os.path.isfile(s.REFERENCE), os.path.isfile(s.DEMO), s.REFERENCE)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert smoke.stdout.startswith(f"True True {bundle}"), smoke.stdout + smoke.stderr[-2000:]  # its data shipped
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


def test_an_editable_install_runs_every_command(tmp_path):
    """docs/install.md's development install (pip install -e .): orb-finetune's entry point must load (an entry point
    in a mapped package, orb._bundle, did not: ModuleNotFoundError), as must msrun's worker script."""
    venv, python, _ = installed(tmp_path, "-e")
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "finetune.py").write_text("print('a script of the user')\n")  # on the path: never the command's
    env = dict(os.environ, PYTHONPATH=str(work))
    for command in ("orb-finetune", "orb-finetune-parallel", "orb-evaluate"):
        result = subprocess.run([str(venv / "bin" / command), "--help"], cwd=work, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: {command} "), (command, result.stderr)
    worker = subprocess.run([str(python), "-c", "from orb.training.launch import worker_script; print(worker_script())"],
                            cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert worker.stdout.strip() == os.path.join(ROOT, "finetune_parallel.py"), worker.stdout + worker.stderr
