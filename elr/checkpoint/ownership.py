"""What in a checkpoint folder this project wrote, and so may delete: nothing else is ever deleted.

A folder is the project's when it is a real folder (not a link) holding nothing but plain files of
the names a save or model export writes (safetensors shards, values.json, config.json, commit.json).
A killed save's `step-N.tmp` of that kind is removed at the next save; any other name in the checkpoint
folder (a user's `my-notes/`, a `step-9.tmp` holding other files, a `step-7.tmp` link) is left and
named, and a save whose own name someone else holds stops with one line.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from elr.checkpoint.format import CONFIG, MARKER
from elr.checkpoint.storage import SHARD, VALUES
from elr.errors import CheckpointError

OWN_TMP = re.compile(r"step-\d+(-model)?\.tmp")  # what a killed save or model export of ours leaves
# Every name this project writes in a checkpoint folder (exports, set-aside and converted steps included)
KNOWN = re.compile(r"train\.lock|step-\d+(-model|-hf)?(\.tmp|\.abandoned-[\w-]+|\.format-\d+|\.converting)?")
SAVED_FILE = re.compile(rf"{SHARD.pattern}|{re.escape(VALUES)}|{re.escape(CONFIG)}|{re.escape(MARKER)}")


def made_here(path: Path) -> bool:
    """A folder this project wrote: a real folder (not a link) holding only plain files of the names a
    save or model export writes. Nothing else is ever deleted."""
    return (
        path.is_dir()
        and not path.is_symlink()
        and all(e.is_file() and not e.is_symlink() and SAVED_FILE.fullmatch(e.name) for e in path.iterdir())
    )


def claim_tmp(tmp: Path) -> None:
    """Make `tmp` free for a save: remove it when this project wrote it (a killed save), else a
    CheckpointError: a name someone else holds is left as it is."""
    if made_here(tmp):
        shutil.rmtree(tmp)
    if tmp.exists() or tmp.is_symlink():
        raise CheckpointError(
            f"checkpoint: {tmp} exists and was not written by this project (it holds other files, "
            "or is a link); it is left as it is: move it away so the save can use the name"
        )


def clear_own_tmp(folder: Path) -> list[str]:
    """Delete what killed saves of ours left in `folder`; return every name the project did not write."""
    foreign = []
    for entry in sorted(folder.iterdir()):
        if OWN_TMP.fullmatch(entry.name) and made_here(entry):
            shutil.rmtree(entry)
        elif not KNOWN.fullmatch(entry.name) or entry.is_symlink() or OWN_TMP.fullmatch(entry.name):
            foreign.append(entry.name + (" (a symbolic link)" if entry.is_symlink() else ""))
    return foreign


def replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` (atomic); an existing `dst` (the same step saved again) goes first, when
    this project wrote it; a name of someone else's stops the commit with one line."""
    if dst.exists() or dst.is_symlink():
        if not made_here(dst):
            raise CheckpointError(
                f"checkpoint: cannot commit {dst.name}: {dst} exists and was not written by "
                "this project; it is left as it is: move it away"
            )
        shutil.rmtree(dst)
    os.rename(src, dst)
    fd = os.open(dst.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside(path: Path, stamp: str) -> Path:
    """Rename `path` to `<name>.abandoned-<stamp>` (with `-2`, `-3`, ... if taken): kept, never resumed,
    pruned or overwritten, and never deleted. Returns the new path."""
    target, n = path.with_name(f"{path.name}.abandoned-{stamp}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.abandoned-{stamp}-{n}")
    os.rename(path, target)
    return target
