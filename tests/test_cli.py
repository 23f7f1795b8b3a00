"""The console commands (pyproject [project.scripts]) run the scripts from any directory, and every
script documents every flag with its default."""

import argparse
import contextlib
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from trainer_utils import ROOT

from elr import cli

SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.py"))


def test_pyproject_names_every_command_and_each_resolves():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == sorted(cli.COMMANDS)
    for command, target in scripts.items():
        module, _, name = target.partition(":")
        assert module == "elr.cli" and callable(getattr(cli, name)), command
        assert (ROOT / cli.COMMANDS[command]).is_file(), command


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_each_command_shows_its_help_from_another_directory(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        cli.run(command, ["--help"])
    assert done.value.code == 0
    assert out.getvalue().startswith(f"usage: {command}"), out.getvalue()[:200]


class Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(path, monkeypatch) -> argparse.ArgumentParser:
    """The script's parser, caught where main() would parse (nothing of the script runs past it)."""

    def catch(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    monkeypatch.setattr(sys, "argv", [path.name])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(Parsed) as caught:
        module.main()
    return caught.value.parser


@pytest.mark.parametrize("path", [*SCRIPTS, ROOT / "train.py"], ids=lambda p: p.name)
def test_every_flag_has_help_with_its_default(path, monkeypatch):
    parser = parser_of(path, monkeypatch)
    shows_defaults = issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{path.name} {name}: no help"
        has_default = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        if has_default:
            assert shows_defaults or "%(default)" in action.help or "default" in action.help, f"{path.name} {name}"


def test_every_repository_file_a_script_help_names_exists(monkeypatch):
    """An example in --help that names a bundled file (data/..., train_configs/...) names one that exists."""
    missing = []
    for path in [*SCRIPTS, ROOT / "train.py"]:
        with monkeypatch.context() as m:
            parser = parser_of(path, m)
        text = parser.format_help()
        for name in re.findall(r"(?<![\w/.])((?:data|train_configs)/[\w./-]+\.(?:jsonl|toml|json|tiktoken|bin))", text):
            if not (ROOT / name).exists():
                missing.append(f"{path.name}: {name}")
    assert not missing, missing


HEAVY = ("torch", "triton", "transformers", "matplotlib", "safetensors")  # seconds to import, each
# Runs each script's --help in one process in which importing any of HEAVY fails, and prints what each did.
BLOCKED_HELP = """
import contextlib, io, json, runpy, sys
for name in {heavy}:
    sys.modules[name] = None  # `import torch` now raises ImportError
results = {{}}
for path in {paths}:
    sys.argv, out = [path, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
        code = None
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{{type(e).__name__}}: {{e}}"
    results[path] = [code, out.getvalue()]
print(json.dumps(results))
"""


def test_every_script_parses_its_arguments_before_importing_torch(tmp_path):
    """--help and a usage error come at once: each script imports torch (and the model code) only once its
    arguments are known. Each --help runs here with torch and the other heavy packages unimportable, and its
    description is a whole paragraph of the script's docstring (never cut mid-sentence)."""
    import ast
    import json

    paths = [str(p) for p in [*SCRIPTS, ROOT / "train.py"]]
    code = BLOCKED_HELP.format(heavy=repr(HEAVY), paths=repr(paths))
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}:{ROOT / 'scripts'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    failed = {Path(p).name: (c, out[-300:]) for p, (c, out) in results.items() if c not in (0, None)}
    assert not failed, failed
    for path, (_, out) in results.items():
        first = ast.get_docstring(ast.parse(Path(path).read_text())).split("\n\n")[0]
        assert " ".join(first.split()) in " ".join(out.split()), f"{Path(path).name}: {out[:500]}"


def test_generate_without_arguments_says_how_to_use_it_without_importing_torch(tmp_path):
    code = "import sys\nsys.modules['torch'] = None\nfrom elr import cli\nsys.exit(cli.run('elr-generate', []))"
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        "elr-generate: error: --checkpoint is required (or --memory with --flavor); `python train.py` run here "
        "saves one"
    )
