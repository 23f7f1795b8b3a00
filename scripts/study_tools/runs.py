"""Study suites and their runs: a base config, variants of it, seeds; trained --jobs at a time.

A suite is a base TOML (train_configs/study/<suite>.toml) and its variants
(train_configs/study/<suite>_variants.toml: each a label, the groups it belongs to and its
--section.key overrides as TOML values, plus a [quick] subset and the groups' [protocol.<group>] tables,
study_tools/protocol.py). Every run is an ordinary checkpointed
`train.py` run in <runs>/<variant>/seed<N>: a finished run (its last step's validation is in its
metrics.jsonl) is skipped, an interrupted one resumes from its checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli

from elr.console.progress import duration

from .protocol import check_protocols

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "train_configs/study"
SUITES = ("text", "depth")


def log(message: str) -> None:
    print(f"[study {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Suite:
    name: str
    config: Path  # the base run
    variants: dict[str, dict]  # name -> {label, groups, overrides}
    quick: dict  # {variants, steps}
    steps: int  # the base run's training.steps
    protocols: dict[str, dict]  # group -> {baseline: variant} (study_tools/protocol.py)

    @classmethod
    def load(cls, name: str) -> Suite:
        if name not in SUITES:
            raise ValueError(f"unknown study suite {name!r}; use one of {', '.join(SUITES)}")
        config = CONFIGS / f"{name}.toml"
        with open(CONFIGS / f"{name}_variants.toml", "rb") as f:
            variants = tomli.load(f)
        with open(config, "rb") as f:
            steps = tomli.load(f)["training"]["steps"]
        quick, protocols = variants.pop("quick"), variants.pop("protocol", {})
        check_protocols(variants, protocols)
        return cls(name, config, variants, quick, steps, protocols)


@dataclass
class Run:
    variant: str
    seed: int
    folder: Path
    overrides: dict
    steps: int  # its updates: the suite's, or a FLOPs-matched run's own (study_tools/protocol.py)

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"


def cli_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def train_command(run: Run, config: Path, data: Path | None, val_steps: int | None) -> list[str]:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(config),
        "--job.dump_folder",
        str(run.folder),
        "--training.seed",
        str(run.seed),
        "--training.steps",
        str(run.steps),
    ]
    if data is not None:
        cmd += ["--data.path", str(data)]
    if val_steps is not None:
        cmd += ["--validation.steps", str(val_steps)]
    for key, value in run.overrides.items():
        cmd += [f"--{key}", cli_value(value)]
    return cmd


def read_records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_record(folder: Path, steps: int) -> dict | None:
    """The run's validation record at its last step, or None if it has not finished."""
    return next((r for r in reversed(read_records(folder)) if r.get("step") == steps and "val/loss_k1" in r), None)


def final_validation(folder: Path, steps: int) -> list[float] | None:
    """Validation loss at k = 1..K of the run's last step, or None if it has not finished."""
    record = final_record(folder, steps)
    if record is None:
        return None
    return [record[f"val/loss_k{k}"] for k in range(1, 1 + sum(key.startswith("val/loss_k") for key in record))]


def latest_checkpoint(folder: Path) -> Path:
    """The run's newest committed checkpoint (the trainer's own rule: a half-written one never counts)."""
    from elr.checkpoint import latest_step

    step = latest_step(folder / "checkpoint")
    if step is None:
        raise FileNotFoundError(f"{folder}: no committed checkpoint")
    return folder / "checkpoint" / f"step-{step}"


def train_all(runs: list[Run], config: Path, data: Path | None, jobs: int, val_steps: int | None = None) -> list[Run]:
    """Train every unfinished run, `jobs` at a time with one thread each, in the given order; returns the runs
    that failed."""
    todo = [r for r in runs if final_record(r.folder, r.steps) is None]
    log(f"{len(runs) - len(todo)} of {len(runs)} runs already finished; training {len(todo)}, {jobs} at a time")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running: list[tuple[Run, subprocess.Popen, float]] = []
    failed, done = [], 0
    began = time.monotonic()
    while todo or running:
        while todo and len(running) < jobs:
            run = todo.pop(0)
            run.folder.mkdir(parents=True, exist_ok=True)
            with open(run.folder / "train.log", "a") as out:
                proc = subprocess.Popen(
                    train_command(run, config, data, val_steps),
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            running.append((run, proc, time.monotonic()))
        time.sleep(1.0)
        for item in list(running):
            run, proc, start = item
            if proc.poll() is None:
                continue
            running.remove(item)
            done += 1
            record = final_record(run.folder, run.steps)
            if proc.returncode != 0 or record is None:
                failed.append(run)
                log(f"FAILED {run.name} (exit {proc.returncode}); see {run.folder / 'train.log'}")
                continue
            summary = " ".join(
                f"{key.split('/')[-1]} {value:.4f}"
                for key, value in record.items()
                if key.startswith(("val/loss_k", "val/acc_k")) and "_d" not in key
            )
            total, elapsed = done + len(todo) + len(running), time.monotonic() - began
            log(
                f"[{done}/{total}] {run.name}: {time.monotonic() - start:.0f} s, {summary} | {duration(elapsed)}, "
                f"eta {duration(elapsed / done * (total - done))}"
            )
    return failed


def earlier_rows(report: Path, suite: str, steps: int) -> dict[str, dict]:
    """The rows of an earlier report (its results.json), for `--carry`: a grid trained in parts, or on
    machines that kept no runs, still reports whole. It must be of the same suite and length."""
    try:
        earlier = json.loads(report.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--carry {report}: not a readable results.json ({e})") from e
    if (earlier.get("suite"), earlier.get("steps")) != (suite, steps):
        raise ValueError(
            f"--carry {report}: a {earlier.get('suite')} report at {earlier.get('steps')} updates, "
            f"not {suite} at {steps}"
        )
    return earlier.get("results", {})


def carried_note(carried: Sequence[str]) -> list[str]:
    """The report's lines naming the rows that came from an earlier report rather than runs kept here."""
    if not carried:
        return []
    return [
        f"Rows carried from an earlier report of the same suite and length (`--carry`; their runs are not "
        f"kept here): {', '.join(f'`{v}`' for v in carried)}.",
        "",
    ]
