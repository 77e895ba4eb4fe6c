"""The documentation is instructions that work: every command line in README.md and docs/ parses with its program's
real parser (config overrides and YAML blocks through the config checker), every relative link and anchor resolves,
the generated references are current, every page opens with its command, and the README's quick start and the
calculator snippet run (a few steps)."""

import argparse
import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# programs documented beside ours: their own tools, not parsed here (a name not listed, a typo of ours, fails)
OTHER_PROGRAMS = {"pip", "git", "cd", "mkdir", "ls", "cat", "cp", "rm", "export", "source", "sbatch", "scontrol",
                  "srun", "if", "then", "fi", "exit", "status=$?", "echo", "npu-smi", "tail", "sha256sum", "unset",
                  "python3", "hyperfine", "ulimit", "du", "wc", "head", "nproc", "module", "conda", "df", "find",
                  "ip", "mount", "which", "uname", "env", "else", "ssh", "sleep", "kill", "diff", "touch"}
PREFIXES = {"srun", "time", "exec", "sudo", "env", "nohup"}


def code_blocks(language_names):
    """(page, block text) of every fenced block in the given languages."""
    for page in PAGES:
        text = open(page, encoding="utf-8").read()
        for match in FENCE.finditer(text):
            if match.group(1) in language_names:
                yield page, match.group(2)


def command_lines(block: str):
    """The block's commands: continuation lines joined, comments dropped, split at ; && || | and redirections left
    out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            yield [line]  # unbalanced quotes: reported as a command that does not parse
            continue
        command = []
        skip_next = False
        for token in tokens:
            if skip_next:
                skip_next = False
                continue
            if token and set(token) <= set(";&|"):
                if command:
                    yield command
                command = []
            elif token and set(token) <= set("<>") or re.fullmatch(r"\d?>>?", token):
                skip_next = True  # a redirection's file
            elif re.fullmatch(r"\d?>>?\S+|\d>&\d", token):
                continue
            else:
                command.append(token)
        if command:
            yield command


def program_and_arguments(tokens):
    """(program, arguments) of a command line: environment assignments and prefixes (srun, time, bash -c '...')
    taken off; a checkout script named as the program it runs."""
    from orb.commands import COMMANDS, SCRIPTS

    tokens = list(tokens)
    while tokens and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]) or tokens[0] in PREFIXES):
        tokens.pop(0)
        while tokens and tokens[0].startswith("-") and len(tokens) > 1:  # a prefix's options (srun --ntasks=1)
            tokens.pop(0)
    if not tokens:
        return None, []
    if tokens[0] == "bash" and len(tokens) > 2 and tokens[1] == "-c":
        inner = [program_and_arguments(t) for t in command_lines(tokens[2])]
        return ("bash -c", inner)
    if tokens[0] in ("python", "python3", "bash", "sh") and len(tokens) > 1:
        script = tokens[1]
        if script in SCRIPTS:
            return SCRIPTS[script], tokens[2:]
        if script.startswith("scripts/") or script in ("finetune_parallel.py",):
            return script, tokens[2:]
        if script == "-m":
            return f"python -m {tokens[2]}" if len(tokens) > 2 else "python -m", tokens[3:]
        if script.startswith(".ci/"):
            return script, tokens[2:]
    if tokens[0] in COMMANDS:
        return tokens[0], tokens[1:]
    return tokens[0], tokens[1:]


def parse_fine_tuning(arguments, launcher: bool) -> None:
    """orb-finetune's and the launcher's arguments: the options, then the config with the --key value overrides
    through the config checker (a config file the page only names, my.yaml, stands for the orb-v3 template)."""
    from orb.bundled import template_path
    from orb.training.cli import finetune_parser
    from orb.training.config import load_config
    from orb.training.launch import split_config

    if launcher:
        config, arguments = split_config(arguments)
        arguments = ["--config", config] + arguments
    args, overrides = finetune_parser().parse_known_args(arguments)
    if args.print_config is not None:
        assert template_path(args.print_config), f"--print-config {args.print_config}: no such template"
        assert not overrides
        return
    config = args.config
    assert config, "no --config"
    if not (os.path.exists(os.path.join(ROOT, config)) or template_path(config)):
        config = "finetune_orb_v3"  # the page's own file (my.yaml)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        load_config(config, overrides)
    finally:
        os.chdir(cwd)


def script_parser(script: str):
    path = os.path.join(ROOT, script)
    assert os.path.exists(path), f"{script} does not exist"
    if script.endswith(".sh"):
        return None
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec = importlib.util.spec_from_file_location(f"documented_{os.path.basename(script)[:-3]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    assert hasattr(module, "build_parser"), f"{script} has no build_parser() to check its documented commands with"
    return module.build_parser()


def check_command(program, arguments) -> None:
    from orb.commands import COMMANDS, parser

    if program == "bash -c":
        for inner_program, inner_arguments in arguments:
            if inner_program:
                check_command(inner_program, inner_arguments)
        return
    if program in ("orb-finetune", "orb-finetune-parallel"):
        parse_fine_tuning(arguments, launcher=program == "orb-finetune-parallel")
    elif program in COMMANDS:
        parser(program).parse_args(arguments)
    elif program.startswith("scripts/"):
        built = script_parser(program)
        if built is not None:
            built.parse_args(arguments)
    elif program == "python -m pytest":
        assert all(os.path.exists(os.path.join(ROOT, a.split("::")[0])) for a in arguments if a.startswith("tests"))
    elif program.startswith(".ci/"):
        assert os.path.exists(os.path.join(ROOT, program))
    else:
        assert program in OTHER_PROGRAMS, f"{program}: not a command of this project nor a known tool"


def documented_commands():
    for page, block in code_blocks(("bash", "sh", "shell", "")):
        for tokens in command_lines(block):
            program, arguments = program_and_arguments(tokens)
            if program:
                yield os.path.relpath(page, ROOT), " ".join(tokens), program, arguments


def test_every_documented_command_parses_with_its_programs_parser():
    failures = []
    count = 0
    for page, line, program, arguments in documented_commands():
        count += 1
        try:
            check_command(program, arguments)
        except SystemExit as exc:  # argparse's refusal (its message went to stderr); 0: --help
            if exc.code == 0:
                continue
            failures.append(f"{page}: {line}  -> argparse exit {exc.code}")
        except Exception as exc:
            failures.append(f"{page}: {line}  -> {type(exc).__name__}: {str(exc)[:200]}")
    assert count > 100  # (the pages hold that many: a parser of the pages that found none would pass)
    assert not failures, "\n".join(failures)


def test_every_yaml_block_is_a_valid_config():
    """A YAML block of the docs is a config or a part of one: merged into the orb-v3 template, it passes the config
    checker."""
    from orb.bundled import template_path
    from orb.training.config import config_from_dict
    from orb.training.config_files import _merge, read_yaml

    template = read_yaml(open(template_path("finetune_orb_v3"), encoding="utf-8").read(), "template")
    blocks = list(code_blocks(("yaml", "yml")))
    assert blocks
    for page, block in blocks:
        values = read_yaml(block, page)
        config_from_dict(_merge(template, values))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: str):
    text = FENCE.sub("", open(page, encoding="utf-8").read())
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES + [os.path.join(ROOT, "CHANGELOG.md")]:
        text = FENCE.sub("", open(page, encoding="utf-8").read())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_generated_references_and_templates_are_current():
    """docs/commands.md and docs/config.md are what scripts/make_references.py writes from the parsers and the
    templates' source, and the templates what scripts/make_templates.py writes: no flag or key lands undocumented."""
    for script in ("make_references.py", "make_templates.py"):
        result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--check"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    for page in ("commands.md", "config.md"):  # an option hidden from --help is hidden here too (it printed
        assert argparse.SUPPRESS not in open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()  # as is)


def test_every_page_opens_with_its_command_and_the_readme_is_short():
    for page in PAGES:
        text = open(page, encoding="utf-8").read()
        if page.endswith("README.md"):
            assert len(text.splitlines()) <= 250
            continue
        body = text.split("\n", 1)[1].lstrip("\n")
        assert text.startswith("# ") and body.startswith("```bash\n"), f"{page} does not open with its command"
    long = [f"{os.path.relpath(p, ROOT)}:{i + 1}" for p in PAGES if not p.endswith(("commands.md", "config.md"))
            for i, line in enumerate(FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), open(p).read()).split("\n"))
            if len(line) > 120 and not line.lstrip().startswith("|")]
    assert not long, f"prose lines over 120 characters: {long}"


def readme_quick_start():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [tokens for block in FENCE.findall(section) for tokens in command_lines(block[1])]


@pytest.mark.alone  # its fine-tuning beside PyTorch loading an export (test_checkpoint), late in the run: 6.2 GB
def test_the_readme_quick_start_runs(tmp_path):
    """The quick start's fine-tuning of the bundled demo, as written, from a folder outside the checkout, cut to one
    epoch; `pip install .` is tests/test_install.py's. A command on the user's own data (my.extxyz and the full-size
    published model: 5.6 GB) is only parsed, by the test above."""
    demo = [t for t in readme_quick_start() if t[0] == "orb-finetune" and t[t.index("--config") + 1] == "demo"]
    assert demo, "the README's quick start no longer runs the demo"
    command = [sys.executable, os.path.join(ROOT, "finetune.py"), *demo[0][1:], "--max_epochs", "1",
               "--device_target", "CPU", "--progress_bar", "false"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (tmp_path / "outputs" / "demo" / "checkpoints" / "best_weights.ckpt").exists()


def test_the_calculator_snippet_runs(tmp_path):
    """docs/use.md's calculator snippet as written, with its files made (a Cu cell; the bundled demo model as the
    fine-tuned checkpoint) and its step counts cut to 3."""
    from ase.build import bulk

    text = open(os.path.join(ROOT, "docs", "use.md"), encoding="utf-8").read()
    snippet = next(block for language, block in FENCE.findall(text)
                   if language == "python" and "ORBCalculator.from_checkpoint" in block)
    structure = re.search(r'read\("([^"]+)"\)', snippet).group(1)
    checkpoint = re.search(r'from_checkpoint\("([^"]+)"\)', snippet).group(1)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=2)
    atoms.write(tmp_path / structure)
    os.makedirs(os.path.dirname(tmp_path / checkpoint), exist_ok=True)
    shutil.copy(os.path.join(ROOT, "data", "demo_pretrained.ckpt"), tmp_path / checkpoint)
    short = re.sub(r"steps=\d+", "steps=3", snippet)
    short = re.sub(r"\.run\((\d+)\)", ".run(3)", short) + "\nprint('energy', atoms.get_potential_energy())\n"
    assert short.count("3)") >= 2
    result = subprocess.run([sys.executable, "-c", short], cwd=tmp_path, capture_output=True, text=True,
                            timeout=900, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "energy" in result.stdout


@pytest.mark.parametrize("line, program", [("orb-finetun --config demo", "orb-finetun"),
                                           ("python scripts/relax.py --fmax", "orb-relax")])
def test_a_wrong_documented_command_is_caught(line, program):
    """The checker itself: a misspelt program and a flag without its value fail."""
    (tokens,) = list(command_lines(line))
    found, arguments = program_and_arguments(tokens)
    assert found == program
    with pytest.raises((AssertionError, SystemExit)):
        check_command(found, arguments)
