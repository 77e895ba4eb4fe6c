"""The config templates, TrainConfig and the model names kept in step; packaged templates found from any folder;
every command's --help showing its defaults and its program's name."""

import argparse
import importlib.util
import os
import shutil
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from orb.errors import ConfigError
from orb.models.config import MODEL_NAMES, ModelConfig
from orb.training.config import TrainConfig, flatten, load_config
from orb.training.config_files import read_yaml

FULL = ("finetune_orb_v3", "finetune_orb_v2", "config_parallel")  # the templates that hold every key
PARALLEL_LEAVES_OUT = {"device_id"}  # msrun gives each worker its device: the only key the parallel one lacks
KEY_LINE = re.compile(r"^(?P<indent>(?:  )?)(?P<out># )?(?P<key>\w+):(?: +(?P<value>[^#\s](?:[^#]*[^#\s])?))? *"
                      r"(?:# (?P<comment>.*))?$")
MODEL_LINE = re.compile(r"^#   (?P<name>orb_\w+) +(?P<what>\S.*)$")


def template(name):
    return os.path.join(ROOT, "configs", f"{name}.yaml")


def key_lines(name):
    """Every key line of a template, by dotted key: (its value's text, its comment, commented out or not). Outside a
    block, a comment is prose; inside one (indented), ``# key: value  # comment`` is a key left commented out."""
    keys, block = {}, ""
    for line in open(template(name), encoding="utf-8").read().splitlines():
        found = KEY_LINE.match(line)
        if not found or (found["out"] and not found["indent"]):
            continue
        if not found["indent"]:
            block = found["key"] if found["value"] is None else ""
            if found["value"] is None:
                continue
        dotted = f"{block}.{found['key']}" if found["indent"] else found["key"]
        assert dotted not in keys, (name, dotted)
        keys[dotted] = (found["value"], found["comment"], bool(found["out"]))
    return keys


def make_templates():
    spec = importlib.util.spec_from_file_location("make_templates", os.path.join(ROOT, "scripts", "make_templates.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_of(key, model_name):
    """The built-in default of ``key`` (an architecture key: the model name's value)."""
    if key.startswith("model.") and key != "model.name":
        return ModelConfig.defaults(model_name)[key[len("model."):]]
    return flatten(TrainConfig().to_dict())[key]


def test_templates_are_what_make_templates_writes():
    """One source: the checked-in templates are the generator's output, and there is no other full template."""
    generator = make_templates()
    assert set(generator.TEMPLATES) == set(FULL)
    for name in FULL:
        assert open(template(name), encoding="utf-8").read() == generator.render(name), \
            f"configs/{name}.yaml differs: run python scripts/make_templates.py"
    assert not os.path.exists(template("config"))  # replaced by the family templates


@pytest.mark.parametrize("name", FULL)
def test_every_key_and_model_name_is_in_the_template_with_a_comment(name):
    lines = key_lines(name)
    expected = set(flatten(TrainConfig().to_dict())) - (PARALLEL_LEAVES_OUT if name == "config_parallel" else set())
    assert set(lines) == expected, (sorted(expected - set(lines)), sorted(set(lines) - expected))
    for key, (value, comment, commented_out) in lines.items():
        assert value is not None and comment, (name, key)
        assert commented_out == (key.startswith("model.") and key != "model.name"), (name, key)
    text = open(template(name), encoding="utf-8").read()
    listed = [found["name"] for found in map(MODEL_LINE.match, text.splitlines()) if found]
    assert listed == list(MODEL_NAMES)  # each once, with a line of what it is
    assert all(len(line) <= 120 for line in text.splitlines())
    cfg = load_config(template(name))  # no key TrainConfig lacks, every value valid
    assert cfg.model.name == cfg.checkpoint_path  # the published weights by name, with their architecture


@pytest.mark.parametrize("name", FULL)
def test_template_values_are_the_defaults_or_say_why_not(name):
    """A trimmed copy of a template changes nothing silently: a value that is not the built-in default says
    ``(default: X; why)`` with the true default, and a value that is the default carries no such mark. The
    commented-out architecture keys show the model name's values."""
    lines = key_lines(name)
    values = flatten(load_config(template(name)).to_dict())
    model_name = values["model.name"]
    differing = set()
    for key, (text, comment, commented_out) in lines.items():
        default = default_of(key, model_name)
        if commented_out:
            assert read_yaml(text, key) == default, (name, key)
            continue
        mark = re.search(r"\(default: (.*?); [^()]*\)$", comment)
        if values[key] == default:
            assert "(default:" not in comment, (name, key)
        else:
            differing.add(key)
            assert mark and read_yaml(mark.group(1), key) == default, (name, key, comment)
    assert {"train_data_path", "output_dir", "checkpoint_path"} <= differing  # the placeholders and the weights


def test_single_device_and_parallel_templates_differ_only_in_device_id():
    single, parallel = key_lines("finetune_orb_v3"), key_lines("config_parallel")
    assert set(single) - set(parallel) == PARALLEL_LEAVES_OUT and not set(parallel) - set(single)
    assert {key: single[key] for key in parallel} == parallel  # same values, same comments
    assert load_config(template("config_parallel")).to_dict() == load_config(template("finetune_orb_v3")).to_dict()


def test_the_two_families_differ_in_model_weights_and_learning_rate_only():
    v3, v2 = (flatten(load_config(template(n)).to_dict()) for n in ("finetune_orb_v3", "finetune_orb_v2"))
    differ = {key for key in v3 if v3[key] != v2[key]}
    architecture = {f"model.{k}" for k in ModelConfig.defaults("orb_v2")} - {"model.name"}
    assert differ - architecture == {"model.name", "checkpoint_path", "output_dir", "lr"}
    assert (v3["lr"], v2["lr"], v3["lr_schedule"], v2["lr_schedule"]) == (1e-4, 3e-4, "cosine", "cosine")


def test_packaged_templates_by_name_from_any_folder(tmp_path, monkeypatch):
    """--config NAME finds a packaged template when no such file is here; in it a relative path to the bundled demo
    data is that file, any other relative path (output_dir, a user's data) is relative to the working folder."""
    monkeypatch.chdir(tmp_path)
    for name in ("demo", "demo.yaml", "configs/demo.yaml"):
        cfg = load_config(name)
        assert cfg.train_data_path == os.path.join(ROOT, "data", "demo_train.db")
        assert cfg.checkpoint_path == os.path.join(ROOT, "data", "demo_pretrained.ckpt")
        assert cfg.output_dir == "outputs/demo"
    assert load_config("demo_label_free").replay.data_path == os.path.join(ROOT, "data", "pretrain",
                                                                            "pretrain_train.db")
    assert load_config("finetune_orb_v3").train_data_path == "my_train.extxyz"  # not bundled: the user's
    mine = tmp_path / "demo.yaml"  # a file of that name here is the user's, read as it is
    mine.write_text("train_data_path: data/demo_train.db\n")
    assert load_config("demo.yaml").train_data_path == "data/demo_train.db"
    assert load_config("demo").train_data_path == os.path.join(ROOT, "data", "demo_train.db")  # no file "demo"
    assert load_config(None, ["--train_data_path", "data/demo_train.db"]).train_data_path == "data/demo_train.db"
    with pytest.raises(ConfigError, match=rf"^config file nope not found in {re.escape(str(tmp_path))}, and no "
                                          r"packaged template is called that \(packaged templates: config_parallel, "
                                          r"demo, .*finetune_orb_v3; orb-finetune --print-config NAME"):
        load_config("nope")


def test_the_demos_data_and_weights_as_the_docs_name_them_from_any_folder(tmp_path, monkeypatch):
    """After `orb-finetune --config demo`, `orb-evaluate --data data/demo_val.db` (as its --help names it) failed in any
    folder but the checkout: "data/demo_val.db: database file does not exist". On a command's line, a data path or
    checkpoint that is not in the working folder but names a bundled file is that file, resolved as the arguments are
    read (every check and message sees it); one that is there is the user's; a config file's paths are as written."""
    from orb.commands import parser
    from orb.errors import DatasetError
    from orb.data.formats import readable_database

    monkeypatch.chdir(tmp_path)
    demo_val, demo_ckpt = (os.path.join(ROOT, "data", name) for name in ("demo_val.db", "demo_pretrained.ckpt"))
    for program, argv, read in (
            ("orb-evaluate", ["--checkpoint", "data/demo_pretrained.ckpt", "--compare", "data/demo_pretrained.ckpt",
                              "--data", "data/demo_val.db"], ("checkpoint", "compare", "data")),
            ("orb-relax", ["--checkpoint", "data/demo_pretrained.ckpt", "--data", "data/demo_val.db", "--output",
                           "out.db"], ("checkpoint", "data")),
            ("orb-md", ["--checkpoint", "data/demo_pretrained.ckpt", "--data", "data/demo_val.db", "--output", "md",
                        "--timestep", "1", "--steps", "1"], ("checkpoint", "data")),
            ("orb-properties", ["--checkpoint", "data/demo_pretrained.ckpt", "--reference", "data/demo_pretrained.ckpt",
                                "--structures", "data/demo_val.db", "--output", "props"],
             ("checkpoint", "reference", "structures")),
            ("orb-export", ["--checkpoint", "data/demo_pretrained.ckpt", "--data", "data/demo_val.db", "--output",
                            "model.mindir"], ("checkpoint", "data")),
            ("orb-convert", ["data/demo_pretrained.ckpt", "out.ckpt"], ("source",))):
        args = parser(program).parse_args(argv)
        for name in read:
            value = getattr(args, name)
            assert value in (demo_ckpt, [demo_val], demo_val), (program, name, value)
    assert parser("orb-evaluate").parse_args(["--checkpoint", "x", "--data", "data/nope.db"]).data == ["data/nope.db"]
    with pytest.raises(DatasetError, match="^data/demo_val.db: database file does not exist"):
        readable_database("data/demo_val.db")  # (a config's path, or a library call: as written)
    (tmp_path / "data").mkdir()
    shutil.copy(os.path.join(ROOT, "data", "demo_train.db"), tmp_path / "data" / "demo_val.db")  # the user's own
    assert parser("orb-evaluate").parse_args(["--checkpoint", "x", "--data", "data/demo_val.db"]).data == [
        "data/demo_val.db"]


def finetune(*args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_print_config_writes_a_template_that_runs_from_anywhere(tmp_path):
    printed = finetune("--print-config", "demo_label_free", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    original = open(template("demo_label_free"), encoding="utf-8").read()
    assert len(printed.stdout.splitlines()) == len(original.splitlines())  # comments and all
    assert f"train_data_path: {os.path.join(ROOT, 'data', 'demo_train.db')}\n" in printed.stdout
    mine = tmp_path / "my.yaml"
    mine.write_text(printed.stdout)
    assert load_config(str(mine)).to_dict() == load_config("demo_label_free").to_dict()
    from orb.bundled import printable_template, template_names

    for name in template_names():  # every packaged template prints as a file that means what the template means
        (tmp_path / f"{name}.yaml").write_text(printable_template(name))
        assert load_config(str(tmp_path / f"{name}.yaml")).to_dict() == load_config(name).to_dict(), name
    assert finetune("--print-config", "finetune_orb_v3", cwd=tmp_path).stdout == \
        open(template("finetune_orb_v3"), encoding="utf-8").read()  # nothing bundled in it: as it is
    for args, message in (
            (["--print-config", "nope"], "error: --print-config nope: no packaged template is called that "
                                         "(packaged templates: config_parallel, demo, "),
            (["--print-config", "demo", "--lr", "1"], "error: --print-config writes a template as it is; edit the "
                                                       "file it writes instead of giving --lr"),
            ([], "error: no --config: name your YAML config file or a packaged template (packaged templates: "
                 "config_parallel, demo, "),
            (["demo", "--max_epochs", "1"], "error: no --config (did you mean --config demo?)"),  # (as the
            # parallel launcher takes it: "no --config" left the user to guess)
            (["--config", ""], "error: --config is empty: name a YAML config file or a packaged template "
                               "(orb-finetune --print-config NAME > my.yaml writes one to edit)"),
            (["--config", "finetune_orb_v2", "--train_data_path", ""],
             "error: config key 'train_data_path' is not set: name your training data")):
        result = finetune(*args, cwd=tmp_path)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert result.stderr.startswith(message), (args, result.stderr)
    assert not (tmp_path / "outputs").exists()  # nothing written


def commands():
    from orb.commands import COMMANDS

    return sorted(COMMANDS)


@pytest.mark.parametrize("program", commands())
def test_every_option_of_every_command_shows_its_default(program):
    """Each option's help ends with its default (or says it is required), as the parser sees it: the parser each
    command runs is the one orb.commands lists (a docs generator reads the same)."""
    from orb.commands import parser

    built = parser(program)
    assert built.prog == program and built.formatter_class.__name__ == "HelpFormatter"
    formatter = built._get_formatter()
    for action in built._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.help == argparse.SUPPRESS:
            continue  # (--help and --version are no settings)
        assert action.help, (program, action.dest)
        text = formatter._expand_help(action)
        may_be_left_out = action.nargs in ("?", "*") or (action.option_strings and not action.required)
        if text.endswith("(required)") or not may_be_left_out:
            assert "(default" not in text, (program, action.dest)
            continue
        assert "(default: " in text, (program, action.dest, text)
        if action.default not in (None, "", []) and "(default: %(default)s)" in formatter._get_help_string(action):
            assert text.endswith(f"(default: {action.default})"), (program, action.dest, text)
    built.format_help()  # every help string formats (a stray % would raise)


@pytest.mark.parametrize("program", ["orb-evaluate", "orb-relax", "orb-md", "orb-properties", "orb-export",
                                     "orb-convert", "orb-download", "orb-plot", "orb-smoke-test",
                                     "orb-finetune-parallel"])
def test_a_misspelt_flag_is_one_line_naming_it_and_the_closest(program, capsys):
    """argparse printed its usage block and, for a misspelt required flag, only that the right one was missing
    (`orb-evaluate --chekpoint X`: "the following arguments are required: --checkpoint")."""
    from orb.commands import parser

    built = parser(program)
    flags = [flag for action in built._actions for flag in action.option_strings if flag.startswith("--")
             and flag != "--help"]
    wrong = flags[0][:-1] + flags[0][-1] * 2  # (a doubled last letter)
    with pytest.raises(SystemExit) as stop:
        built.parse_args([wrong, "x"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{program}: error: unrecognized arguments: {wrong} (did you mean {flags[0]}?)"), lines


def test_the_closest_option_is_the_one_begun_and_never_help(capsys):
    """`--temp` suggested --tdamp, `--chek` --help, a stray `--` "--xc"."""
    from orb.commands import closest, parser

    md = [f for a in parser("orb-md")._actions for f in a.option_strings if f.startswith("--")]
    assert closest("--temp", md) == " (did you mean --temperature?)"
    assert closest("--chek", [f for a in parser("orb-evaluate")._actions for f in a.option_strings]) == \
        " (did you mean --checkpoint?)"
    assert closest("--hel", ["--help", "--xc"]) == ""
    evaluate = parser("orb-evaluate")  # a flag typed with one dash, or pasted with a document's dash: named too
    for typed in ("-checkpoint", "\u2014checkpoint"):
        with pytest.raises(SystemExit):
            evaluate.parse_args([typed, "x", "--data", "y"])
        assert capsys.readouterr().err.startswith(f"orb-evaluate: error: unrecognized arguments: {typed} (did you "
                                                  "mean --checkpoint?)")
    with pytest.raises(SystemExit):  # (a negative number is a value, not a flag: argparse's own message)
        parser("orb-relax").parse_args(["--checkpoint", "x", "--data", "y", "--output", "z", "--fmax", "-1", "-q"])
    assert "unrecognized arguments: -q;" in capsys.readouterr().err


def test_the_table_of_commands_is_the_installed_one():
    from orb.commands import COMMANDS, SCRIPTS

    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    scripts = text.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    installed = dict(re.findall(r'^([\w-]+) = "orb\.programs:(\w+)"$', scripts, re.MULTILINE))
    assert set(installed) == set(COMMANDS) and set(SCRIPTS.values()) == set(COMMANDS)
    import orb.programs

    for program, name in installed.items():  # each runs the main of the module that builds its parser
        assert getattr(orb.programs, name).module == COMMANDS[program].split(":")[0], program
    assert all(os.path.exists(os.path.join(ROOT, script)) for script in SCRIPTS)


def test_the_wheel_lists_every_orb_package_and_ships_the_bundle():
    """pyproject.toml lists the packages by hand (a mapped folder cannot be found): a new subpackage must be listed,
    and the bundle's folders (configs/, data/, ...) exist where the mapping says."""
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    listed = set(re.findall(r'"(orb[\w.]*)"', text.split("\npackages = [", 1)[1].split("]", 1)[0]))
    found = {os.path.relpath(folder, ROOT).replace(os.sep, ".")
             for folder, _, files in os.walk(os.path.join(ROOT, "orb")) if "__init__.py" in files}
    assert found and found == {p for p in listed if not p.startswith("orb._bundle")}
    mapped = dict(re.findall(r'^"(orb\._bundle[\w.]*)" = "([\w/]+)"$', text, re.MULTILINE))
    assert set(mapped) == {p for p in listed if p.startswith("orb._bundle")}
    assert all(os.path.isdir(os.path.join(ROOT, folder)) for folder in mapped.values())


def test_every_script_says_its_own_name_and_defaults(tmp_path):
    """--help of each script of the checkout, run from another folder: its own name (run_parallel.sh said
    'usage: launch.py'), defaults shown, and finetune.py reading more than an ASE database."""
    from orb.commands import SCRIPTS

    for script in SCRIPTS:
        command = ["bash"] if script.endswith(".sh") else [sys.executable]
        result = subprocess.run([*command, os.path.join(ROOT, script), "--help"], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120, env=dict(os.environ, COLUMNS="120"))
        assert result.returncode == 0, (script, result.stderr[-2000:])
        assert result.stdout.startswith(f"usage: {os.path.basename(script)} "), (script, result.stdout[:200])
        assert "(default: " in result.stdout, script
    help_text = finetune("--help", cwd=tmp_path).stdout
    assert "extxyz" in help_text and "an ASE database" not in help_text and "finetune_orb_v3" in help_text


def test_run_parallel_sh_finds_its_checkout_by_any_path(tmp_path):
    """The script finds its checkout in bash itself (no subshell, whose wait could lose a stop signal sent to bash
    started with it ignored: tests/test_signals.py covers that cause), by a bare name, a relative path from another
    folder and a path through a link alike."""
    (tmp_path / "link").symlink_to(ROOT)
    for cwd, path in ((ROOT, "run_parallel.sh"), (ROOT, "./run_parallel.sh"), (tmp_path, os.path.relpath(
            os.path.join(ROOT, "run_parallel.sh"), tmp_path)), (tmp_path, "link/run_parallel.sh")):
        result = subprocess.run(["bash", path, "--help"], cwd=cwd, capture_output=True, text=True, timeout=120,
                                env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert result.returncode == 0 and result.stdout.startswith("usage: run_parallel.sh "), (path, result.stderr)


def test_the_launcher_finds_its_config_from_any_folder(tmp_path, monkeypatch, capsys):
    """run_parallel.sh with no config reads configs/config_parallel.yaml (the checkout's or the package's) from any
    folder; CONFIG, or --config CONFIG as orb-finetune takes it, is found the same way; the rest goes to the workers."""
    from orb.bundled import find_config, templates_dir
    from orb.training.launch import DEFAULT_CONFIG, main, split_config

    monkeypatch.chdir(tmp_path)
    assert split_config(["--max_epochs", "3"]) == (DEFAULT_CONFIG, ["--max_epochs", "3"])
    assert find_config(DEFAULT_CONFIG) == os.path.join(templates_dir(), "config_parallel.yaml")
    assert split_config(["finetune_orb_v2", "--lr", "1e-4"]) == ("finetune_orb_v2", ["--lr", "1e-4"])
    assert split_config(["--lr", "1e-4", "--config", "my.yaml"]) == ("my.yaml", ["--lr", "1e-4"])
    assert split_config(["--config=my.yaml", "--resume", "auto"]) == ("my.yaml", ["--resume", "auto"])
    for args, message in ((["nope.yaml"], f"error: config file nope.yaml not found in {tmp_path}, and no packaged "
                                          "template is called that (packaged templates: config_parallel, "),
                          (["a.yaml", "--config", "b.yaml"], "error: the config is given twice (a.yaml, b.yaml)")):
        assert main(args, prog="run_parallel.sh") == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
