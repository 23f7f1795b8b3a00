"""What in a checkpoint folder this project wrote, and so may delete: nothing else is ever deleted.

A folder is the project's when it is a real folder (not a link) holding nothing but plain files of
the names a save or model export writes (safetensors shards, values.json, config.json, commit.json).
A killed save's `step-N.tmp` of that kind is removed at the next save; any other name in the checkpoint
folder (a user's `my-notes/`, a `step-9.tmp` holding other files, a `step-7.tmp` link) is left and
named, and a save whose own name someone else holds stops with one line. An old checkpoint is pruned by
renaming it `step-N.pruning` first, then deleting it: a file that cannot be deleted leaves the rest under
that name (never resumed, tried again at the next save) and one line, never a half checkpoint as `step-N`.
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
PRUNING = re.compile(r"step-\d+\.pruning")  # an old checkpoint being deleted (what an undeletable file kept)
# Every name this project writes in a checkpoint folder (exports, set-aside and converted steps included)
KNOWN = re.compile(
    r"train\.lock|step-\d+(-model|-hf)?(\.tmp|\.abandoned-[\w-]+|\.format-\d+|\.converting)?|step-\d+\.pruning"
)
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
        elif PRUNING.fullmatch(entry.name) and made_here(entry):
            shutil.rmtree(entry, ignore_errors=True)  # an undeletable file: named when the prune first met it
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


def prune(path: Path) -> str | None:
    """Delete an old checkpoint this project wrote (anything else is left): renamed `step-N.pruning` first
    (atomic), so a deletion that fails part way leaves no half checkpoint under a name a resume reads, then
    deleted. Returns None, or the one line that says what could not be deleted and where it is."""
    if not made_here(path):
        return None
    aside = path.with_name(path.name + ".pruning")
    try:
        if made_here(aside):  # what an earlier prune of the same name left
            shutil.rmtree(aside)
        os.rename(path, aside)
    except OSError as e:
        return f"checkpoint: could not move the old checkpoint {path} aside to delete it ({_why(e)}); it is kept whole"
    try:
        shutil.rmtree(aside)
    except OSError as e:
        return (
            f"checkpoint: could not delete the old checkpoint {path} ({_why(e)}); what is left of it is in "
            f"{aside.name} (never resumed): the next save tries again, or delete it by hand"
        )
    return None


def _why(e: OSError) -> str:
    """The error and the file it met ("Operation not permitted: values.json")."""
    name = Path(e.filename).name if e.filename else ""
    return f"{e.strerror or e}: {name}" if name else str(e.strerror or e)
