"""Tests never write into the working tree: every run, export and prepared dataset goes to a temporary
folder, so `python train.py` (which writes outputs/debug) followed by the test command still passes,
and the tests leave the checkout as they found it. Checked once per session against `git status`."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORED_BY_DESIGN = (".venv/", ".pytest_cache/", ".hypothesis/", "__pycache__/", ".egg-info/")  # tools' caches
# Where a test's run, export or dataset would land: the default dump folders, the bundled data and configs.
# (Edits of the code and docs made while the tests run are a developer's, not the tests'.)
WATCHED = ("outputs/", "data/", "train_configs/", "checkpoint/")


def working_tree() -> set[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode != 0:  # not a git checkout (an sdist, say): nothing to compare
        return set()
    lines = [line for line in out.stdout.splitlines() if not any(part in line for part in IGNORED_BY_DESIGN)]
    state = {
        line for line in lines if line[3:].startswith(WATCHED) or ("/" not in line[3:] and line[:2] in ("??", "!!"))
    }
    # git shows an ignored folder (outputs/) as one line: what is written inside it is read from the files
    for folder in ("outputs", "checkpoint"):
        state |= {f"{p.relative_to(ROOT)} {p.stat().st_mtime_ns}" for p in (ROOT / folder).rglob("*") if p.is_file()}
    return state


@pytest.fixture(scope="session", autouse=True)
def the_working_tree_is_left_as_it_was():
    before = working_tree()
    yield
    written = sorted(working_tree() - before)
    assert not written, f"tests wrote into the working tree: {written[:10]}"
