"""What a resume may change: the job's config against the one the checkpoint was saved with.

A resume is explicit. Keys that change the model or what the saved state means (`FROZEN`) are
refused in one line naming them, before anything is built or written. Every other key may change
and applies from the resumed step on; the trainer logs the differences once ("changed on resume:
optimizer.lr 0.006 -> 0.001 (from step 31)") and config.json keeps a list of every resume's
changes. The schedule after a change: the LR scheduler is rebuilt from the new config
(`lr_scheduler.*`, `optimizer.lr`, `training.steps`) and evaluated at the resumed step, so raising
`training.steps` from 20 to 30 at step 20 continues the new 30-step cosine at its step 20.

A run resumed at or past its last step has nothing to do: `finished_step` finds that before any
file is opened for writing, once that checkpoint's files pass their hash check and its config
describes this job's run (another model, tokenizer or data is refused, not called finished).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from elr.checkpoint import export_path, latest_step, read_config, verify
from elr.config import JobConfig, recurrence
from elr.data.job_data import job_tokenizer_path
from elr.data.mixture import describe_change
from elr.errors import ConfigError, UnusableCheckpoint
from elr.text.tokenizer import build_tokenizer

# Keys whose change would build another model, or make the saved optimizer state, data position or
# loop draws mean something else: every recurrence option (each changes the network), and these.
FROZEN = (
    "model.flavor",
    "elr.enabled",
    "elr.partition",  # the baseline or not; the layers in each block
    *(f"elr.{name}" for name in recurrence.names()),
    "elr.switch_conditioning",  # whether the one-loop phase's model holds the conditioning
    "optimizer.name",  # AdamW and Muon+AdamW keep different state
    "training.seq_len",
    "training.seed",
    "data.shuffle",  # the data position counts windows of this order
    "data.task",
    "data.task_items",
    "data.task_max_difficulty",  # the task's vocabulary and example length
    "data.path",
    "tokenizer.sha256",  # another corpus or vocabulary is another run (run_folder.py)
)
# Keys that record where this run lives or how it was started: expected to differ, never logged.
IGNORED = ("checkpoint.load_step", "checkpoint.initial_load_path", "checkpoint.create_seed", "job.start_over")
RESUMES = "resumes"  # config.json's list of {step, changes}


def flat(config: dict) -> dict[str, object]:
    """{"section.key": value} of a config dict (`JobConfig.to_dict()` or a saved config.json)."""
    return {f"{s}.{k}": v for s, section in config.items() if isinstance(section, dict) for k, v in section.items()}


def config_changes(saved: dict, job: dict) -> dict[str, list]:
    """{key: [saved value, job value]} for every key that differs (keys new since the save count
    as their defaults, which the saved config did not have: they are compared to nothing)."""
    old, new = flat(saved), flat(job)
    changes = {}
    for key, value in new.items():
        if (
            key in IGNORED
            or key not in old
            or old[key] == value
            or (key == "data.path" and _same_folder(old[key], value))
        ):
            continue
        if key in ("tokenizer.sha256", "data.meta_sha256") and not value:  # empty: the trainer records it
            continue
        changes[key] = [old[key], value]
    return changes


def check_resume(saved: dict, job: dict, step: int) -> dict[str, list]:
    """The allowed changes of a resume at `step`; a ConfigError naming every frozen key that changed. A new
    mixture (data.sources) brings its own folders, so their meta.json hash changes with it."""
    changes = config_changes(saved, job)
    if "data.sources" in changes:
        changes.pop("data.meta_sha256", None)
    if "data.meta_sha256" in changes:  # the same folder prepared again (prepare_data.py --replace): other data
        was, now = changes["data.meta_sha256"]
        raise ConfigError(
            f"data.meta_sha256: the data under {job['data']['path']} changed since the run began (its "
            f"meta.json has SHA-256 {now}, checkpoint step-{step} was saved with {was}): resume on the "
            "data it began with, or start a new run (another job.dump_folder, or --job.start_over true)"
        )
    frozen = [k for k in changes if k in FROZEN]
    if frozen:
        listed = ", ".join(f"{k} {show_value(changes[k][0])} -> {show_value(changes[k][1])}" for k in frozen)
        raise ConfigError(
            f"{', '.join(frozen)}: cannot change on resume (checkpoint step-{step} was saved with "
            f"another value: {listed}); use the saved value, or a new job.dump_folder for a new run "
            "(or --job.start_over true to set this folder's run aside and start over in it)"
        )
    return changes


def _same_folder(a, b) -> bool:
    """Two spellings of one data folder (relative and absolute, say)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, TypeError):
        return False


def change_line(changes: dict[str, list], step: int) -> str:
    """The one log line of a resume's changes (a mixture's by source: `data.sources web 0.6 -> 0.5, ...`)."""
    return (
        "changed on resume: "
        + "; ".join(
            f"{k} {describe_change(a, b)}" if k == "data.sources" else f"{k} {show_value(a)} -> {show_value(b)}"
            for k, (a, b) in changes.items()
        )
        + f" (from step {step + 1})"
    )


def show_value(value) -> str:
    """A config value as TOML writes it: 0.006, "text", true, [0.9, 0.95]."""
    return f"{value:g}" if isinstance(value, float) else json.dumps(value)


def finished_step(cfg: JobConfig) -> int | None:
    """The step a finished run stopped at, when this job would resume it at or past training.steps.
    A ConfigError when that checkpoint holds another run (a frozen key differs)."""
    c = cfg.checkpoint
    if not c.enable or c.create_seed or cfg.job.start_over:
        return None
    folder = Path(cfg.job.dump_folder) / c.folder
    step = latest_step(folder) if c.load_step == -1 else c.load_step
    if step is None or step < cfg.training.steps:
        return None
    if c.export_dtype != "none" and not export_path(folder, step, c.export_format).exists():
        return None  # its export failed (a full disk): the trainer loads the step and writes the export
    try:
        marker = verify(folder / f"step-{step}", step)
    except UnusableCheckpoint:
        return None  # the trainer falls back to an older step and says why
    saved = read_config(folder / f"step-{step}", marker)
    if saved is not None:
        job = cfg.to_dict()
        if not cfg.data.task and not job["tokenizer"]["sha256"]:  # the trainer records it once it runs
            job["tokenizer"]["sha256"] = build_tokenizer(job_tokenizer_path(cfg)).sha256
        check_resume(saved, job, step)
    return step


def run_config(cfg: JobConfig, history: list[dict]) -> dict:
    """What config.json holds: the config that runs now, and the changes of every resume so far."""
    return {**cfg.to_dict(), RESUMES: history}


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the records of metrics.jsonl past `step` (a resume continues from there; a fresh start,
    step 0, keeps none), atomically: a temporary file, then os.replace. Returns the records dropped."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if step > 0 and _step_of(line) is not None and _step_of(line) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    """A record's step; None for a line a killed writer left torn."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return None
