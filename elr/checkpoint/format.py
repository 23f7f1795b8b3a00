"""What a committed checkpoint folder holds, and the checks made before anything in it is parsed.

    step-N/   `shard-*.safetensors` (tensors, one file per rank) and `values.json` (every other item;
              elr/checkpoint/storage.py), `config.json` (the job's config, so inference builds the
              network that was trained, whatever later runs write elsewhere), and `commit.json`,
              written last: {"format", "step", "time", "files": {name: bytes}, "sha256": {name: hex}}

A folder without commit.json is an unfinished save and never loads. Before any file of it is parsed,
the folder must hold exactly the files the marker lists (plain files, no links, nothing else) and
each must match its size and SHA-256, so a flipped bit, a cut copy, a replaced or added file is found
before it is trained on or evaluated. Formats: 1-3 kept tensors and items in DCP's pickle-based
files (`.metadata`, `__{rank}_0.distcp`); this version never reads them and says how to convert
them (scripts/convert_checkpoint.py, run once in a process that trusts the folder). 4 holds no pickle.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from elr.errors import CheckpointError, OldCheckpointFormat, UnusableCheckpoint
from elr.models.layers import LAYER_KINDS
from elr.text.tokenizer import file_sha256

MARKER = "commit.json"
STEP_DIR = re.compile(r"step-(\d+)")  # a checkpoint folder's name (`step-N.tmp` is an unfinished save)
CONFIG = "config.json"  # the job config inside a step folder (format >= 3)
FORMAT = 4
PICKLE_FREE = 4  # formats before this one stored DCP's pickled `.metadata`: never read, converted instead
CONVERT = "scripts/convert_checkpoint.py"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def hash_files(folder: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of each named file; hashlib releases the GIL, so a few threads read in parallel."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(folder / name), names)))


def committed_files(folder: Path) -> list[str]:
    """The files a marker for `folder` must cover: every file but the marker (DCP writes no subfolders)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER)


def write_marker(folder: Path, step: int, sha256: dict[str, str]) -> None:
    """Commit `folder`: sizes and the given hashes of every file in it, then fsync."""
    names = committed_files(folder)
    if sorted(sha256) != names:
        raise RuntimeError(f"{folder}: hashes given for {sorted(sha256)}, files are {names}")
    marker = {
        "format": FORMAT,
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": {name: (folder / name).stat().st_size for name in names},
        "sha256": sha256,
    }
    with open(folder / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_marker(folder: str | Path, step: int | None = None) -> dict:
    """The folder's commit marker, well formed (and for `step`, when given), or UnusableCheckpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UnusableCheckpoint(folder, "does not exist")
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        raise UnusableCheckpoint(folder, f"has no {MARKER} (an unfinished save, or not a checkpoint)") from None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past the parser's depth
        raise UnusableCheckpoint(folder, f"has an unreadable {MARKER} ({e})") from None
    problem = _marker_problem(marker)
    if problem:
        raise UnusableCheckpoint(folder, f"has a malformed {MARKER} ({problem})")
    if step is not None and marker["step"] != step:
        raise UnusableCheckpoint(folder, f"has a {MARKER} for step {marker['step']}")
    if marker.get("format", 1) > FORMAT:
        raise UnusableCheckpoint(
            folder,
            f"was saved in checkpoint format {marker['format']}, newer than this "
            f"code's {FORMAT}: load it with the version that wrote it",
        )
    if marker.get("format", 1) < PICKLE_FREE:
        raise OldCheckpointFormat(
            f"checkpoint {folder} is in format {marker.get('format', 1)}, whose DCP .metadata is a pickle that this "
            f"version never reads; if you trust the folder, convert it once with: python {CONVERT} {folder}"
        )
    return marker


def _marker_problem(marker: Any) -> str | None:
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(marker, dict) or not is_int(marker.get("step")) or not is_int(marker.get("format", 1)):
        return "no integer step and format"
    files = marker.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(n, str) and Path(n).name == n and n not in (".", "..") and is_int(s) and s >= 0
        for n, s in files.items()
    ):
        return "files must map plain file names to sizes"
    if marker.get("format", 1) >= PICKLE_FREE or "sha256" in marker:
        sha = marker.get("sha256")
        if (
            not isinstance(sha, dict)
            or set(sha) != set(files)
            or not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in sha.values())
        ):
            return "sha256 must give a hex digest for every file"
    return None


def check_sizes(folder: Path, marker: dict) -> None:
    """The folder holds exactly the marker's files, plain files (no links), of the marker's sizes."""
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink():
            raise UnusableCheckpoint(folder, f"has {entry.name}, a symbolic link (a checkpoint holds plain files)")
        if entry.name != MARKER and entry.name not in marker["files"]:
            raise UnusableCheckpoint(folder, f"has {entry.name}, which {MARKER} does not list (added after the save)")
    for name, size in marker["files"].items():
        file = folder / name
        if not file.is_file():
            raise UnusableCheckpoint(folder, f"lacks file {name}")
        if file.stat().st_size != size:
            raise UnusableCheckpoint(folder, f"has file {name} of {file.stat().st_size} bytes, {MARKER} says {size}")


def check_hashes(folder: Path, marker: dict, hashes: dict[str, str]) -> None:
    """Compare `hashes` (computed by the caller, possibly split over ranks) with the marker's."""
    for name, digest in sorted(marker.get("sha256", {}).items()):
        if hashes.get(name) != digest:
            raise UnusableCheckpoint(
                folder, f"has file {name} whose SHA-256 differs from {MARKER}'s (corrupted or modified)"
            )


def verify(folder: str | Path, step: int | None = None) -> dict:
    """Every check, in this process: marker, file list and sizes, the SHA-256 of every file. Returns the marker."""
    folder = Path(folder)
    marker = read_marker(folder, step)
    check_sizes(folder, marker)
    check_hashes(folder, marker, hash_files(folder, sorted(marker["sha256"])))
    return marker


def check_format(path: Path, marker: dict, saved_keys) -> None:
    """Refuse a checkpoint holding weights of a layer kind in a layout the kind has since changed
    (the conversion of an old checkpoint asks this; a format-4 folder is past every such change)."""
    saved = marker.get("format", 1)
    for kind in LAYER_KINDS.values():
        for layout in kind.layouts:
            if saved < layout.since_format and any(layout.weight in key.split(".") for key in saved_keys):
                raise CheckpointError(
                    f"{path} holds {layout.old} (checkpoint format {saved}, now {FORMAT}); "
                    "this version would read them in the new layout, so it does not load them"
                )


def key_problems(
    requested: dict[str, tuple | None],
    saved: dict[str, tuple | None],
    unexpected: list[str],
    allow_missing: Callable[[str], bool],
    words: tuple[str, str, str],
) -> list[str]:
    """What keeps `saved` from filling `requested` ({key: shape, or None where there is none to
    compare}): missing keys (unless allowed), the `unexpected` ones and differing shapes, each part
    named by `words` (missing, unexpected, shapes)."""
    missing = [k for k in requested if k not in saved and not allow_missing(k)]
    misshapen = [
        f"{k} {saved[k]} vs {shape}"
        for k, shape in requested.items()
        if shape is not None and saved.get(k) is not None and saved[k] != shape
    ]
    return [
        f"{len(keys)} {what}: {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"
        for what, keys in zip(words, (missing, unexpected, misshapen))
        if keys
    ]


def check_keys(
    state_dict: dict[str, Any],
    saved: dict[str, tuple | None],
    allow_missing: Callable[[str], bool],
    *,
    only_requested_roots: bool = True,
) -> None:
    """Raise CheckpointError naming the keys unless the request and the checkpoint ({flat key: tensor
    shape, or None for a plain value}) agree: the same keys, shapes, and tensors where tensors are asked.

    Checkpoint keys under a requested top-level name must be requested; with
    `only_requested_roots=False` (a plain module's state dict) every checkpoint key must be.
    """
    requested, _ = flatten_state_dict(state_dict)  # the same keys DCP's planner uses
    roots = tuple(f"{name}." for name in state_dict)
    unexpected = [k for k in saved if k not in requested and (not only_requested_roots or f"{k}.".startswith(roots))]
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in requested.items()}
    problems = key_problems(
        shapes,
        saved,
        unexpected,
        allow_missing,
        (
            "requested keys missing from the checkpoint",
            "checkpoint keys not requested",
            "shapes differ (checkpoint vs requested)",
        ),
    )
    recast = [k for k in requested if k in saved and (shapes[k] is None) != (saved[k] is None)]
    if recast:
        problems.append(
            f"{len(recast)} stored as a tensor where a value is requested or the other way round: "
            + ", ".join(recast[:5])
            + (", ..." if len(recast) > 5 else "")
        )
    if problems:
        raise CheckpointError("; ".join(problems))


def first_nonfinite(state_dict: dict[str, Any]) -> str | None:
    """The first floating-point tensor holding a NaN or Inf (this rank's shard of a DTensor), or None."""
    flat, _ = flatten_state_dict(state_dict)
    for key, value in flat.items():
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            return key
    return None


def read_config(folder: Path, marker: dict) -> dict | None:
    """The job config saved inside a verified folder, or None where the saver gave none (a bare
    CheckpointManager, a conversion of a checkpoint that had none)."""
    if CONFIG not in marker["files"]:
        return None
    return read_json_object(folder, CONFIG, "a config")


def read_json_object(folder: Path, name: str, what: str) -> dict:
    """A JSON object file of a verified folder; UnusableCheckpoint naming it if it is not one."""
    try:
        value = json.loads((folder / name).read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past the parser's depth
        raise UnusableCheckpoint(folder, f"has an unreadable {name} ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise UnusableCheckpoint(folder, f"has a {name} that is not {what}")
    return value


def step_folders(folder: Path) -> list[int]:
    """Steps of every `step-N` folder in a checkpoint folder, committed or not, newest first (a link
    named so is not one: a checkpoint's files are read in place, never through a link)."""
    folders = folder.iterdir() if folder.is_dir() else []
    return sorted(
        (int(m[1]) for p in folders if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()),
        reverse=True,
    )


def committed_steps(folder: Path) -> list[int]:
    """Steps of `step-N` folders with a marker, newest first (not yet checked)."""
    return [s for s in step_folders(folder) if (folder / f"step-{s}" / MARKER).is_file()]


def marker_or_reason(folder: Path, step: int) -> dict | str:
    """The marker of `folder/step-{step}` if its sizes hold, else why not (cheap: no hashing)."""
    path = folder / f"step-{step}"
    try:
        marker = read_marker(path, step)
        check_sizes(path, marker)
        return marker
    except UnusableCheckpoint as e:
        return e.reason


def export_path(folder: Path, step: int, export_format: str) -> Path:
    """Where the model export at the end of a run goes (`checkpoint.export_format`: dcp or hf)."""
    return folder / f"step-{step}-{'hf' if export_format == 'hf' else 'model'}"


def latest_step(folder: str | Path) -> int | None:
    """The newest committed checkpoint in `folder` whose marker and sizes hold, or None: what a resume
    tries first (reads the folder; no collectives, no hashing)."""
    folder = Path(folder)
    return next((s for s in committed_steps(folder) if isinstance(marker_or_reason(folder, s), dict)), None)


def first_line(e: BaseException) -> str:
    """An error's type and the first line of its message, cut at 160 characters: for one-line reports."""
    text = (str(e).strip().split("\n") or [""])[0]
    return f"{type(e).__name__}: {text[:157] + '...' if len(text) > 160 else text}"
