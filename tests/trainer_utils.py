"""Shared helpers for the end-to-end trainer tests: a tiny debug job, run in-process or as a script; and a
small looped model with a batch of tokens for the tests of recurrence options."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from elr.config import load_config
from elr.config.recurrence import names as recurrence_names
from elr.models import build_model, flavors
from elr.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = ROOT / "train_configs" / "debug.toml"

# Seconds per run on a 2-core CPU: 32-token windows, two slots of two sequences per update. Checkpoints
# as the defaults have them (off, every 500 steps, the newest 3), not as the quick start saves its weights.
TINY = [
    "--checkpoint.enable",
    "false",
    "--checkpoint.interval",
    "500",
    "--checkpoint.keep_latest_k",
    "3",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "2",
    "--validation.steps",
    "1",
    "--validation.freq",
    "0",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--data.path",
    str(ROOT / "data" / "tinyprose"),
    "--tokenizer.path",
    str(ROOT / "data" / "tokenizer" / "elr8k.tiktoken"),
]


def model_args(base, **changes):
    """`base` (ModelArgs) with `changes`: recurrence options (the [elr] names) go into its `recurrence`,
    the rest are ModelArgs fields."""
    options = {k: changes.pop(k) for k in list(changes) if k in recurrence_names()}
    return dataclasses.replace(base, **changes).with_recurrence(**options)


LOOPED_BASE = flavors["task_gpt"]  # 1/2/1, attention + SwiGLU: small and exact on CPU


def looped_model(seed=0, **options) -> torch.nn.Module:
    """LOOPED_BASE at K = 3 with the learned step, 32 positions, `options` on top; initialised from `seed`."""
    torch.manual_seed(seed)
    model = build_model(
        model_args(LOOPED_BASE, max_seq_len=32, **{"max_loops": 3, "update": "adaptive_delta", **options})
    )
    model.init_weights()
    return model


def token_batch(B=2, T=12, seed=1) -> torch.Tensor:
    """[B, T] token ids of LOOPED_BASE's vocabulary, from `seed`."""
    return torch.randint(0, LOOPED_BASE.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def overrides(dump: Path, steps: int, *extra: str) -> list[str]:
    return [*TINY, "--training.steps", str(steps), "--job.dump_folder", str(dump), *extra]


def run(dump: Path, steps: int, *extra: str) -> dict[int, float]:
    """Train in this process; returns {step: training loss}."""
    trainer = Trainer(load_config(DEBUG_TOML, overrides(dump, steps, *extra)))
    try:
        trainer.train()
    finally:
        trainer.close()
    return losses(dump) if (dump / "metrics.jsonl").exists() else {}


def run_script(dump: Path, steps: int, *extra: str, nproc: int = 1, timeout: int = 240) -> dict[int, float]:
    """Train through train.py (torchrun --standalone for nproc > 1)."""
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*launcher, str(ROOT / "train.py"), "--config", str(DEBUG_TOML), *overrides(dump, steps, *extra)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses(dump)


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss/train"] for r in records(dump) if "loss/train" in r}


def copy_checkpoint(src_dump: Path, step: int, dst_dump: Path) -> None:
    shutil.copytree(src_dump / "checkpoint" / f"step-{step}", dst_dump / "checkpoint" / f"step-{step}")
