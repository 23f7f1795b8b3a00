"""The console commands (pyproject [project.scripts]) run the scripts from any directory, and every
script documents every flag with its default."""

import argparse
import contextlib
import importlib.util
import io
import re
import sys

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
