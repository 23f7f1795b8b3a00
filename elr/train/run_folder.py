"""A run's folder is its own: a folder that holds a run is continued or refused, never silently restarted.

A dump folder holds a run once a trainer wrote its config.json or metrics.jsonl there, or saved a
checkpoint. A job in such a folder
- continues it from the newest usable checkpoint (the trainer's line "resumed from ..."), when that
  checkpoint's config describes the same run: the same model, tokenizer and data, and no other
  frozen key changed (elr/train/resume.py; a run of another model, tokenizer or data is refused);
- starts that run again from step 0, with one line, when it is this job's run (config.json: checkpoints on,
  no frozen key changed) and committed no checkpoint: stopped, killed or interrupted twice before its first
  save was done, it has nothing else to continue from; its config.json, metrics.jsonl and tb/ are set
  aside (renamed `<name>.abandoned-<time>`), never deleted;
- is refused in one line, before anything is written, when there is nothing to continue from
  (checkpoint.enable is false, or the run saved no checkpoint and is another job's);
- with `job.start_over = true` starts a new run there, with one line: the earlier run's checkpoints,
  config.json, metrics.jsonl and tb/ are set aside (renamed `<name>.abandoned-<time>`, as a rollback
  does), never deleted.
A folder that holds nothing gets one line saying a new run starts there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from elr.checkpoint import step_folders
from elr.checkpoint.ownership import set_aside
from elr.config import JobConfig
from elr.errors import ConfigError
from elr.train.resume import FROZEN, config_changes

logger = logging.getLogger("elr")

RUN_FILES = ("config.json", "metrics.jsonl", "tb")  # what a trainer writes in its dump folder


def held_run(dump_folder: Path, checkpoint_folder: Path) -> list[str]:
    """What of an earlier run the folders hold (names for one line), or [] when nothing."""
    held = [name for name in RUN_FILES if (dump_folder / name).exists()]
    steps = step_folders(checkpoint_folder)
    if steps:
        held.append(f"checkpoints up to step-{steps[0]}")
    return held


def claim_line(cfg: JobConfig, checkpoint_folder: Path, resume_step: int | None) -> tuple[str | None, bool]:
    """The line saying what this job does with its dump folder (None when a resume says it: resume_step),
    and whether the earlier run's files are set aside first (a start over, or a restart of this job's run
    that committed no checkpoint); a ConfigError (one line) when the folder holds a run the job would
    silently restart."""
    dump = Path(cfg.job.dump_folder)
    held = held_run(dump, checkpoint_folder)
    if cfg.job.start_over:
        return (
            f"starting over in {dump} (job.start_over): the earlier run's {', '.join(held)} set aside as "
            "<name>.abandoned-<time>"
            if held
            else f"new run in {dump}"
        ), True
    if resume_step is not None:
        return None, False
    if cfg.checkpoint.enable and step_folders(checkpoint_folder):
        return None, False  # checkpoints none of which is usable: the load names why each failed
    if not held:
        return f"new run in {dump}", False
    if cfg.checkpoint.enable and unsaved_run_of(cfg, dump):
        return (
            f"starting the run in {dump} again from step 0: it committed no checkpoint (it stopped before its "
            f"first save was done); its {', '.join(held)} set aside as <name>.abandoned-<time>"
        ), True
    why = "checkpoint.enable is false" if not cfg.checkpoint.enable else "it saved no checkpoint"
    raise ConfigError(
        f"job.dump_folder: {dump} holds a run ({', '.join(held)}) that this job cannot continue ({why}) "
        "and would overwrite; use another job.dump_folder, or --job.start_over true to start over "
        "there (the earlier run's files are set aside, not deleted)"
    )


def unsaved_run_of(cfg: JobConfig, dump: Path) -> bool:
    """Whether the run whose config.json `dump` holds is this job's (checkpoints on, and no frozen key or
    data preparation differs): such a run that committed no checkpoint is started again, not refused."""
    try:
        saved = json.loads((dump / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(saved, dict) or not isinstance(saved.get("checkpoint"), dict):
        return False
    if saved["checkpoint"].get("enable") is not True:
        return False
    return not any(key in FROZEN or key == "data.meta_sha256" for key in config_changes(saved, cfg.to_dict()))


def set_aside_run_files(dump_folder: Path) -> list[str]:
    """Rename the earlier run's config.json, metrics.jsonl and tb/ to `<name>.abandoned-<time>` (rank 0)."""
    stamp, moved = time.strftime("%Y%m%d-%H%M%S"), []
    for name in RUN_FILES:
        path = dump_folder / name
        if path.exists():
            moved.append(set_aside(path, stamp).name)
    return moved
