"""Learning-rate schedule and configuration validation."""

import os
import re

import numpy as np
import pytest

from conftest import ROOT

from orb.training.config import load_config, parse_overrides
from orb.errors import ConfigError


def test_config_overrides_and_errors(tmp_path):
    cfg = load_config(None, ["--max_epochs", "3", "--lr", "1e-3", "--model.num_message_passing_steps", "2",
                             "--loss_weights.stress=0", "--buckets", "[[64, 1280]]"])
    assert cfg.max_epochs == 3 and cfg.lr == 1e-3 and cfg.model.num_message_passing_steps == 2
    assert cfg.loss_weights.stress == 0 and cfg.buckets == [[64, 1280]]
    assert parse_overrides(["--a.b", "true"]) == {"a": {"b": True}}
    listed = load_config(None, ["--train_data_path", "[a.extxyz, b.db]", "--replay.data_path", "[omat]"])
    assert listed.train_data_path == ["a.extxyz", "b.db"] and listed.replay.data_path == "omat"
    assert load_config(None, ["--num_buckets", "0"]).num_buckets == 0  # chosen for the run
    for args, message in [
        (["--max_epoch", "3"], "unknown config key 'max_epoch' \\(did you mean 'max_epochs'\\?\\)"),
        (["--batch_size", "eight"], "'batch_size' must be an integer"),
        (["--lr", "-1"], "'lr' must be positive"),
        (["--device_target", "TPU"], "'device_target' must be one of"),
        (["--kernels", "builtin"], "config key 'kernels' is now 'ops_profile' \\(auto \\| portable \\| cpu; 'builtin'"),
        (["--ops_profile", "fast"], "'ops_profile' must be one of"),
        (["--matmul_precision", "low"], "'matmul_precision' must be one of"),
        (["--model.latent", "3"], "unknown config key 'model.latent'"),
        (["--loss_weights.energy", "0", "--loss_weights.forces", "0", "--loss_weights.stress", "0"], "all 0"),
        (["--max_epochs"], "has no value"),
        (["--val_data_path", "[a.db, '']"], "'val_data_path' lists an empty path"),
        (["--train_data_path", "[a.db, [b.db]]"], "'train_data_path\\[1\\]' must be a string"),
        (["--num_buckets", "-1"], "'num_buckets' must be 0 \\(chosen\\) to 16"),
        (["--initial_loss_scale", "0.5"], "'initial_loss_scale' must be in \\[1, 2\\^24\\]"),
        (["--initial_loss_scale", "nan"], "config key 'initial_loss_scale' must be a finite number"),
        # non-finite numbers and out-of-range seeds were accepted (a NaN lr trained NaN; a negative seed crashed
        # numpy with a traceback)
        (["--lr", "nan"], "config key 'lr' must be a finite number, got nan"),
        (["--gradient_clip_val", ".inf"], "config key 'gradient_clip_val' must be a finite number, got inf"),
        (["--loss_weights.energy", "nan"], "config key 'loss_weights.energy' must be a finite number"),
        (["--replay.loss_weight", "nan"], "config key 'replay.loss_weight' must be a finite number"),
        (["--model.radius", "nan"], "config key 'model.radius' must be a finite number"),
        (["--save_every_minutes", "inf"], "config key 'save_every_minutes' must be a finite number"),
        (["--random_seed", "-1"], "config key 'random_seed' must be >= 0, got -1"),
        (["--random_seed", str(2 ** 32)], "config key 'random_seed' must be below 4294967296"),
        # an integer beyond float's range was an OverflowError traceback; huge counts and sizes were accepted
        (["--lr", "1" + "0" * 400], "config key 'lr' must be a finite number, got 1000000000"),
        (["--batch_size", str(10 ** 30)], "config key 'batch_size' must be below 4294967296, got 10000000000"),
        (["--data_workers", "100000"], "config key 'data_workers' must be 0 .* to 256, got 100000"),
        (["--device_id", "-2"], "config key 'device_id' must be >= 0"),
        (["--callbacks", "[mymodule]"], "config key 'callbacks\\[0\\]' must be 'module:Name'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, args)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  latent_dim: 64\n  mlp_hiden_dim: 3\n")
    with pytest.raises(ConfigError, match="model.mlp_hiden_dim"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=f"^config file {tmp_path}/missing.yaml not found \\(packaged templates: "):
        load_config(str(tmp_path / "missing.yaml"))



def test_a_config_file_means_what_it_says_or_is_refused_in_one_line(tmp_path):
    """PyYAML's YAML 1.1 read an output_dir of 0123 as 83 (octal) and 12:30 as 750 (base 60), trained into those
    folders, and kept the last of two equal keys silently; an empty or 'false' file meant the built-in defaults; a
    key that is not a name, a file that is not UTF-8 text were tracebacks; an empty output_dir wrote the run into
    the working directory; 2**32 epochs asked for a 256 GiB table. Each is refused in one line, or kept as text."""
    import subprocess
    import sys

    from orb.training.cli import parse_command_line

    for text in ("0123", "12:30", "2024-01-01", "1_000", "on", "1:30.5", "1.10", "2.0"):
        assert load_config(None, ["--output_dir", text]).output_dir == text  # typed: as typed
    (tmp_path / "float.yaml").write_text("energy_key: 1.10\n")  # in a file, a float's text may not come back
    with pytest.raises(ConfigError, match="config key 'energy_key' must be a string, got 1.1 \\(quote it\\)"):
        load_config(str(tmp_path / "float.yaml"))
    cases = {"dup.yaml": ("lr: -1\nlr: 0.001\n", "dup.yaml, line 2: config key 'lr' is given twice"),
             "block.yaml": ("model:\n  latent_dim: 8\nmodel:\n  latent_dim: 16\n", "line 3: config key 'model' is "
                                                                                    "given twice"),
             "key.yaml": ("1: 2\n", "key.yaml, line 1: config key 1 is not a name"),
             "empty.yaml": ("", "empty.yaml is empty"),
             "false.yaml": ("false\n", "false.yaml must hold a mapping of settings"),
             "syntax.yaml": ("lr: [1, 2\n", "syntax.yaml is not valid YAML, line 2: expected ',' or ']'"),
             # an unknown key of a file named the key alone, as if typed on the command line
             "typo.yaml": ("lr: 0.001\nmax_epoch: 3\n", f"config file {tmp_path / 'typo.yaml'}, line 2: unknown "
                                                        "config key 'max_epoch' (did you mean 'max_epochs'?)"),
             "nested.yaml": ("lr: 0.001\nmodel:\n  latent: 3\n", "nested.yaml, line 3: unknown config key "
                                                                  "'model.latent' (did you mean 'model.latent_dim'?)"),
             "renamed.yaml": ("kernels: cpu\n", "renamed.yaml, line 1: config key 'kernels' is now 'ops_profile'")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as refused:
            load_config(str(tmp_path / name))
        assert message in str(refused.value) and "\n" not in str(refused.value), name
    (tmp_path / "merge.yaml").write_text("defaults: &d\n  energy: 2.0\n  stress: 0.5\nloss_weights:\n  <<: *d\n"
                                         "  stress: 0.0\n")  # a merge key, and a key that overrides a merged one
    with pytest.raises(ConfigError, match="unknown config key 'defaults'"):  # (merged, not refused as YAML)
        load_config(str(tmp_path / "merge.yaml"))
    (tmp_path / "fine.yaml").write_text("lr: 0.001\n")
    for overrides in (["--max_epoch", "3"], ["--model.latent", "3"]):  # typed on the command line: said as before
        with pytest.raises(ConfigError, match=r"^unknown config key '(max_epoch|model\.latent)' \(did you mean"):
            load_config(str(tmp_path / "fine.yaml"), overrides)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfelr: 1\n")
    with pytest.raises(ConfigError, match="binary.yaml is not UTF-8 text"):
        load_config(str(tmp_path / "binary.yaml"))
    for args, message in [
        (["--output_dir", ""], "config key 'output_dir' is empty"),
        (["--output_dir", "~"], "config key 'output_dir' is empty"),
        (["--lr", "1e308"], "config key 'lr' must be at most 1"),
        (["--max_epochs", str(2 ** 32 - 1)], "config key 'max_epochs' must be at most 1000000"),
        (["--model.max_neighbors", str(2 ** 32 - 1)], "config key 'model.max_neighbors' must be at most 10000"),
        (["--loss_weights.energy", "1e308"], "config key 'loss_weights.energy' must be at most 1000000"),
        (["--model.rbf_radius", "1e300"], "config key 'model.rbf_radius' must be at most 100.0"),  # NaN basis centres
        (["--model.polynomial_order", str(2 ** 32 - 1)], "config key 'model.polynomial_order' must be at most 64"),
        (["--batch_size", str(2 ** 32 - 1)], "config key 'batch_size' must be at most 1000000"),  # a 128 GiB bucket
        (["--model.num_elements", str(2 ** 32 - 1)], "config key 'model.num_elements' must be at most 118"),
        (["--lora.alpha", "1e300"], "config key 'lora.alpha' must be at most 1000000"),
        (["--lr_multipliers", "{heads: 1e300}"], "config key 'lr_multipliers.heads' must be 0 \\(freezes the "
                                                  "group\\) to 1e6, got 1e\\+300"),
        (["--freeze", "[layers:1-0]"], "config key 'freeze\\[0\\]': 'layers:1-0' runs backwards: write layers:0-1"),
        (["--lora.rank", "16", "--model.mlp_hidden_dim", "8"], "'lora.rank' \\(16\\) is above the narrowest layer "
                                                                 "width \\(8\\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, args)
    assert load_config(None, ["--gradient_clip_mode", "none", "--gradient_clip_val", "0"]).gradient_clip_val == 0
    shipped = os.path.join(ROOT, "configs", "finetune_orb_v2.yaml")  # it says precision: the old key typed overrides it
    assert load_config(shipped, ["--matmul_precision", "highest"]).precision == "float32-highest"
    with pytest.raises(ConfigError, match=r"^unknown option --over \(did you mean --overwrite\?\)$"):  # no abbreviation
        parse_command_line(["--over", "--conf", "x.yaml"], "configs/config.yaml")
    with pytest.raises(ConfigError, match=r"^unknown option --conf \(did you mean --config\?\)$"):  # no config key
        parse_command_line(["--conf", "x.yaml"], "configs/config.yaml")
    empty = subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config", ""], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and empty.stderr.strip() == ("error: --config is empty: name a YAML config file or a "
                                                              "packaged template (orb-finetune --print-config NAME > "
                                                              "my.yaml writes one to edit)")


def test_shipped_configs_are_valid():
    """(tests/test_templates.py checks the templates' keys, comments and values against TrainConfig.)"""
    from conftest import ROOT

    for name in ("finetune_orb_v2.yaml", "demo.yaml", "demo_pretrain.yaml"):
        cfg = load_config(f"{ROOT}/configs/{name}")
        assert cfg.model.radius == 10.0 and cfg.model.max_neighbors == 20
    assert load_config(f"{ROOT}/configs/finetune_orb_v2.yaml").model.num_message_passing_steps == 15
    # the model's name sets its whole architecture
    for name in ("finetune_orb_v3.yaml", "config_parallel.yaml"):
        v3 = load_config(f"{ROOT}/configs/{name}").model
        assert (v3.latent_dim, v3.mlp_hidden_dim, v3.num_message_passing_steps, v3.radius, v3.max_neighbors) == \
            (256, 1024, 5, 6.0, 120)
    other = ["--checkpoint_path", "orb_v3_direct_20_omat", "--model.name", "orb_v3_direct_20_omat"]
    v3_20 = load_config(f"{ROOT}/configs/finetune_orb_v3.yaml", other).model
    assert (v3_20.latent_dim, v3_20.max_neighbors) == (256, 20)  # another name: its own architecture, nothing stuck
    with pytest.raises(ConfigError, match="'checkpoint_path' names the published weights of "
                                          "orb_v3_conservative_inf_omat, but 'model.name' is orb_v3_direct_20_omat"):
        load_config(f"{ROOT}/configs/finetune_orb_v3.yaml", other[2:])  # the template names both: change both


def test_reference_tables_of_orb_models_070_by_name(tmp_path):
    """reference_energies.table picks a published table (orb-models 0.7.0's names); its vasp-shifted table is the one
    orb-v2 was trained with; a JSON file's entries go on top; an unknown name lists the valid ones."""
    import numpy as np

    from orb.models.reference_energies import reference_table, table_names, vasp_shifted
    from orb.training.config import config_from_dict
    from orb.training.setup import build_model

    assert {"vasp-r2scan", "matpes-pbe", "matpes-r2scan", "mpsalex-d4-pbe", "omol25-hof-lin"} <= set(table_names())
    np.testing.assert_allclose(reference_table("vasp-shifted"), vasp_shifted(), rtol=0, atol=1e-12)
    for name in table_names():
        assert reference_table(name).shape == (118,) and np.isfinite(reference_table(name)).all()
    override = tmp_path / "e0.json"
    override.write_text('{"O": -7.5}')
    small = dict(name="orb_v3_direct_20_omat", latent_dim=16, mlp_hidden_dim=16, num_message_passing_steps=1,
                 head_mlp_hidden_dim=16)
    cfg = config_from_dict(dict(model=small, reference_energies=dict(table="matpes-pbe", file=str(override))))
    weight = build_model(cfg).reference_energy_weight().asnumpy()
    expected = reference_table("matpes-pbe")
    expected[8] = -7.5
    np.testing.assert_allclose(weight, expected.astype(np.float32))
    with pytest.raises(ConfigError, match="unknown table 'vasp-r2scn'; valid names: vasp, vasp-shifted"):
        config_from_dict(dict(reference_energies=dict(table="vasp-r2scn")))


def test_callbacks_are_made_from_their_names_or_refused_in_one_line():
    from orb.training.setup import load_callbacks

    made = load_callbacks(["stop_callbacks:KillAtStep7"])  # (made, not called)
    assert type(made[0]).__name__ == "KillAtStep7"
    for name, message in (("no_such_module:X", "ModuleNotFoundError"), ("collections:NoSuchName", "AttributeError")):
        with pytest.raises(ConfigError, match=f"config key 'callbacks\\[0\\]': cannot make {name} \\({message}"):
            load_callbacks([name])


class MisspeltHook:
    def on_epoch_ends(self, trainer, record):
        raise AssertionError("never called")


def test_a_callback_with_none_of_the_hooks_is_refused_naming_them():
    """A class whose hook was misspelt (``on_epoch_ends``), or any class at all (``json:JSONDecoder``), was taken and
    never called."""
    from orb.training.setup import load_callbacks

    for name in ("test_schedule_config:MisspeltHook", "json:JSONDecoder"):
        with pytest.raises(ConfigError, match=re.escape(f"config key 'callbacks[0]': {name} has none of the hooks a "
                                                        "callback may define (on_train_step, on_validation_batch, "
                                                        "on_epoch_end)")):
            load_callbacks([name])


def test_every_shipped_config_loads_and_the_label_free_demo_protects_without_labels():
    """Every file in configs/ is a valid config (a key renamed in the code but left there would break a user's first
    command); the label-free demo replays the foundation with pseudo-labels, picks its best epoch with them and keeps
    the foundation's normalisers."""
    import glob

    from orb.training.config import load_config

    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        load_config(path)
    cfg = load_config(os.path.join(ROOT, "configs", "demo_label_free.yaml"),
                      ["--train_data_path", "t.db", "--val_data_path", "v.db", "--max_epochs", "20"])
    assert cfg.replay.labels == "model" and cfg.replay.fraction > 0 and cfg.replay.in_selection
    assert cfg.replay.val_samples > 0 and os.path.exists(os.path.join(ROOT, cfg.replay.data_path))
    assert not cfg.online_normalisation  # (the normalisers keep the foundation's statistics)


def test_settings_a_run_cannot_act_on_are_said_at_the_start(tmp_path):
    """A batch larger than the data (the log said 'batch size: 100000 global'), an equigrad or confidence weight for
    a model without that term, the training data as validation data or listed twice: each was accepted in silence."""
    from orb.training.setup import settings_that_do_nothing

    def notes(*extra):
        return settings_that_do_nothing(load_config(None, ["--train_data_path", "a.db", "--val_data_path", "b.db",
                                                           *extra]), 64)

    assert notes() == [] and notes("--model.name", "orb_v3_conservative_20_omat", "--loss_weights.equigrad", "2") == []
    assert notes("--batch_size", "100") == ["batch_size 100 is more than the 64 training structures: each epoch is "
                                            "one step of all 64"]
    assert notes("--loss_weights.equigrad", "2") == ["loss_weights.equigrad 2 is not used: orb_v2 has no equigrad term"]
    assert notes("--model.name", "orb_v3_direct_20_omat", "--loss_weights.equigrad", "1") == [
        "loss_weights.equigrad 1 is not used: orb_v3_direct_20_omat has no equigrad term"]
    assert notes("--loss_weights.confidence", "3") == ["loss_weights.confidence 3 is not used: orb_v2 has no "
                                                       "confidence term"]
    assert "is also training data" in notes("--val_data_path", "./a.db")[0]
    folder = tmp_path / "data"  # a validation file inside a training folder (it trained in silence)
    folder.mkdir()
    for name in ("train.xyz", "val.xyz"):
        (folder / name).write_text("")
    assert notes("--train_data_path", str(folder), "--val_data_path", str(folder / "val.xyz")) == [
        f"validation data {folder / 'val.xyz'} is also training data: its metrics do not measure generalisation"]
    assert notes("--train_data_path", "[a.db, ./a.db]") == [
        "train_data_path lists a file twice: its structures count twice per epoch"]
    assert notes("--val_data_path", "v.db", "--val_fraction", "0.05") == [  # a template's split, a file given
        "val_fraction 0.05 is not used: val_data_path is validated (a template's split applies only when no "
        "validation data is given)"]


def test_an_element_beyond_the_models_table_is_named_before_training(tmp_path):
    """model.num_elements below an element of the data trained until MindSpore's Gather kernel failed with a C++
    stack; the first row holding such an element is named at start-up."""
    import subprocess
    import sys

    from conftest import DEMO_TRAIN, DEMO_VAL

    result = subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config", "finetune_orb_v2",
                             "--checkpoint_path", "", "--train_data_path", DEMO_TRAIN, "--val_data_path", DEMO_VAL,
                             "--device_target", "CPU", "--output_dir", str(tmp_path / "run"),
                             "--model.num_elements", "20"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (f"error: {DEMO_TRAIN}, row 1, key 'numbers': Pd (Z=46) is beyond "
                                                      "the elements of the model (model.num_elements 20)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry, said", [
    ('{"Cu": 1e300}', "energy of 'Cu' must be a number of eV per atom below 1e+07 in size, got 1e+300"),
    ('{"Cu": NaN}', "energy of 'Cu' must be a number of eV per atom below 1e+07 in size, got nan"),
    ('{"Cu": true}', "energy of 'Cu' must be a number of eV per atom below 1e+07 in size, got True"),
    ('{"Xx": -3.5}', "unknown or unsupported element 'Xx'"),
    ('["Cu", -3.5]', "expected an object mapping element symbols to eV")])
def test_a_reference_energies_file_is_checked_with_the_config(tmp_path, entry, said):
    """A reference energy beyond float32's sums (1e300) was read at the model's build and made every step's loss NaN
    an epoch later, blamed on the data; each entry is checked with the config now, in one line naming file and
    element. A good file's entries go over the table."""
    from orb.models.reference_energies import load_reference_file

    path = tmp_path / "refs.json"
    path.write_text(entry)
    with pytest.raises(ConfigError, match=re.escape(f"reference_energies.file {path}: {said}")):
        load_config(None, ["--reference_energies.file", str(path)])
    path.write_text('{"Cu": -3.5, "O": -4.9}')
    assert load_config(None, ["--reference_energies.file", str(path)]).reference_energies.file == str(path)
    table = load_reference_file(str(path), np.ones(118))
    assert table[29] == -3.5 and table[8] == -4.9 and table[1] == 1.0
