"""Console entry points (pyproject [project.scripts]): `elr-train`, `elr-generate`, ... from any directory.

Each command runs the repository's own script (train.py, scripts/*.py) by its `main()`, so the
README's `python scripts/x.py` and the installed `elr-x` are one program. A new command is one line
in `COMMANDS` and one in pyproject.toml. The scripts live in the checkout, so the commands need the
editable install (`pip install -e .`) that the README uses.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]

# command -> the script it runs, relative to the repository
COMMANDS = {
    "elr-train": "train.py",
    "elr-generate": "scripts/generate.py",
    "elr-evaluate": "scripts/evaluate.py",
    "elr-export": "scripts/export_hf.py",
    "elr-prepare-data": "scripts/prepare_data.py",
    "elr-train-tokenizer": "scripts/train_tokenizer.py",
    "elr-plot-loops": "scripts/plot_loops.py",
    "elr-study": "scripts/study.py",
    "elr-estimate-cost": "scripts/estimate_cost.py",
    "elr-plan-memory": "scripts/plan_memory.py",
    "elr-serve": "scripts/serve.py",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The scripts' --help: the docstring as written, and each flag's default after its help (not
    for flags whose default is nothing, or whose help already says it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "%(default)" in text
            or "default" in text
            or not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
        ):
            return text
        return text + " (default: %(default)s)"


def run(command: str, argv: list[str] | None = None) -> int:
    """Load the script of `command` from the repository and call its main (argv: sys.argv[1:])."""
    path = REPOSITORY / COMMANDS[command]
    if not path.is_file():
        print(
            f"{command}: error: {path} is missing; the commands run the repository's scripts, install it "
            "with `pip install -e .` from a checkout",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(path.parent))  # scripts import their siblings (train_tokenizer -> prepare_data)
    spec = importlib.util.spec_from_file_location(f"elr_command_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if argv is not None:
        sys.argv = [command, *argv]
    else:
        sys.argv[0] = command
    result = module.main()  # every script's main reads sys.argv[1:] when given no argv
    return 0 if result is None else int(result)


def _entry(command: str):
    def main() -> int:
        return run(command)

    main.__name__ = command.removeprefix("elr-").replace("-", "_")
    main.__doc__ = f"`{command}`: {COMMANDS[command]}"
    return main


def argument_type(parse):
    """An argparse `type` from a parser that raises ValueError: its message becomes argparse's error
    (argparse shows its own generic one for a ValueError)."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


# one function per command, named as pyproject's [project.scripts] refers to it (elr.cli:prepare_data)
for _command in COMMANDS:
    globals()[_command.removeprefix("elr-").replace("-", "_")] = _entry(_command)
