"""Where numbers go: a console line per log step, TensorBoard scalars, metrics.jsonl, optionally W&B.

metrics.jsonl holds one JSON object per optimizer step (and per evaluation), so two runs can be
compared line by line by any tool; TensorBoard gets the same scalars under the same names. A resumed
run continues both: records past the resumed step are dropped first (elr/train/resume.py) and
TensorBoard purges its events from there, so every step appears once.

Both files are written in the calling thread (`EventFile`, not torch's SummaryWriter, whose writer
thread dies on a full disk with a traceback while the run goes on): a write that fails for space or
permission is caught in `MetricsLogger.log`, and the trainer stops after a checkpoint.

What each step reports (FLOPs, throughput, the logging window and the console line) is made in
elr/train/step_report.py; this module writes it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import socket
import time
from pathlib import Path

import torch

from elr.config import JobConfig
from elr.train.resume import config_changes, show_value, truncate_metrics

logger = logging.getLogger("elr")


def log_run_setup(cfg: JobConfig, model, dims, device: torch.device, n_micro: int, global_batch: int) -> None:
    """What a run prints before its first step: the model, the layout and batch of an update, and the
    config as far as it differs from the defaults."""
    a, t = model.args, cfg.training
    n_params = sum(p.numel() for p in model.parameters())
    n_in, n_rec, n_out = a.partition
    lines = [
        f"model {cfg.model.flavor}: {n_params:,} parameters | layers {a.layer_pattern} "
        f"(input {n_in}, recurrent {n_rec}, output {n_out}) | ELR {'on' if cfg.elr.enabled else 'off (baseline)'}, "
        f"update {a.recurrence.update}, conditioning {'on' if a.recurrence.conditioning else 'off'}, "
        f"K={a.recurrence.max_loops}",
        f"{dims.world_size} rank(s) on {device.type} (dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} "
        f"x cp {dims.cp} x tp {dims.tp}) | {n_micro} microbatch(es) x {t.local_batch_size} x {t.seq_len} tokens "
        f"per data-parallel rank per update | global batch {global_batch} | "
        f"{model.num_flops_per_token(t.seq_len, 1) / 1e9:.3f} GFLOP/token at k=1",
    ]
    for line in lines:
        logger.info(line)
    differs = config_changes(JobConfig().to_dict(), cfg.to_dict())
    logger.info(
        "config (what differs from the defaults; all of it in config.json): "
        + ", ".join(f"{k} {show_value(v)}" for k, (_, v) in differs.items())
    )
    s, steps = cfg.lr_scheduler, cfg.training.steps
    if s.warmup_steps > steps:
        logger.warning(
            f"lr_scheduler.warmup_steps = {s.warmup_steps} exceeds training.steps = {steps}: the "
            "learning rate never reaches optimizer.lr"
        )


# Dense bf16 peak TFLOP/s per device, from the vendors' datasheets; the first name found in the device's
# name wins (so "H100 PCIe" before "H100").
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "GH200": 989.0,
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "B200": 2250.0,
    "MI300X": 1307.0,
}


def peak_tflops(configured: float, device: torch.device) -> float | None:
    """The peak MFU is measured against: the configured one, else the device's from PEAK_TFLOPS; None
    for a device without a known peak (a CPU), whose MFU is not reported rather than shown as 0."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def outputs_line(
    dump_folder: Path, step: int, steps: int, tensorboard: bool, checkpoint: Path | None, export: Path | None = None
) -> str:
    """A run's last line: what it wrote and where, so the next command (generate, evaluate, plot) can start."""
    outputs = [str(dump_folder / "metrics.jsonl"), str(dump_folder / "config.json")]
    if tensorboard:
        outputs.append(f"TensorBoard {dump_folder / 'tb'}")
    outputs.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.enable is false)")
    if export:
        outputs.append(f"export {export}")
    return f"{'finished' if step >= steps else 'stopped'} at step {step}/{steps}; outputs: {', '.join(outputs)}"


class MetricsLogger:
    """Writes only on rank 0; every rank may call it. `start_step`: the step this session resumes
    from (0: a fresh run), whose later records a killed run may have left behind."""

    def __init__(
        self,
        dump_folder: Path,
        enable_tensorboard: bool,
        rank: int,
        start_step: int = 0,
        enable_wandb: bool = False,
        config: dict | None = None,
    ):
        self.enabled = rank == 0
        self.failed = ""  # what could not be written, once a write failed: the trainer stops after a save
        self.events = None
        self.jsonl = None
        self.wandb = None
        if not self.enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        dropped = truncate_metrics(dump_folder / "metrics.jsonl", start_step)
        if dropped:
            logger.info(f"metrics.jsonl: dropped {dropped} record(s) past step {start_step}, which this run redoes")
        self.jsonl = open(dump_folder / "metrics.jsonl", "a", buffering=1)
        writing = dump_folder / "tb"
        try:
            if enable_tensorboard:
                # one run in TensorBoard: events at or past the next step (a killed run's) are purged
                self.events = EventFile(writing, purge_step=start_step + 1 if start_step else 0)
                writing = self.events.path
                if config is not None and not start_step:  # a resume keeps the fresh run's record
                    record_config(self.events, config)
                self.events.flush()
        except OSError as e:  # the run lock found the folder writable, but the disk may be full
            self.failed = f"could not write {writing} before step {start_step + 1} ({e.strerror or e})"
        if enable_wandb:
            self.wandb = _wandb_run(dump_folder, config)

    def log(self, step: int, scalars: dict[str, float], record: dict | None = None) -> None:
        """TensorBoard scalars, plus one jsonl line holding the scalars and any extra fields."""
        if not self.enabled or self.failed:
            return
        writing = self.jsonl.name
        try:
            if self.events is not None:
                writing = self.events.path
                self.events.add_scalars(scalars, step)
                writing = self.jsonl.name
            if self.wandb is not None:
                self.wandb.log(scalars, step=step)
            self.jsonl.write(json.dumps({"step": step, **scalars, **(record or {})}) + "\n")
        except OSError as e:  # a full or read-only disk: not a reason to lose the steps since the last save
            self.failed = f"could not write {writing} at step {step} ({e.strerror or e})"

    def log_text(self, step: int, name: str, body: str) -> None:
        """A text record in TensorBoard's TEXT tab (markdown), if it is on."""
        if not self.enabled or self.failed or self.events is None:
            return
        from torch.utils.tensorboard.summary import text

        try:
            self.events.add_summary(text(name, body), step)
            self.events.flush()
        except OSError as e:
            self.failed = f"could not write {self.events.path} at step {step} ({e.strerror or e})"

    def close(self) -> None:
        for file in (self.events, self.jsonl):
            if file is not None:
                try:
                    file.close()
                except OSError:  # the buffered tail of a disk that is full: the resume redoes those steps
                    pass
        if self.wandb is not None:
            self.wandb.finish()


class EventFile:
    """A TensorBoard event file (`events.out.tfevents.*`, the records TensorBoard reads), written in the
    calling thread: a failed write raises OSError where the step is logged. `purge_step`: TensorBoard
    drops the events an earlier session wrote at or past it (a resumed run redoes those steps)."""

    _sessions = itertools.count()  # two sessions of one process in one second get two files

    def __init__(self, folder: Path, purge_step: int):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._record = Event, RecordWriter
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(self._sessions)}"
        )
        self.file = open(self.path, "xb")
        self.add(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
        self.add(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def add(self, event) -> None:
        self._record(self.file).write(event.SerializeToString())  # tensorboard's framing (length, CRCs)

    def add_summary(self, summary, step: int) -> None:
        self.add(self._event(wall_time=time.time(), step=step, summary=summary))

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """One scalar per name at `step`, then a flush: a full disk is found at this step, not later."""
        from torch.utils.tensorboard.summary import scalar

        for name, value in scalars.items():
            self.add_summary(scalar(name, value), step)
        self.flush()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def record_config(events: EventFile, config: dict) -> None:
    """The run's config in TensorBoard: the whole of it as text (TEXT tab), and its keys as hparams
    (HPARAMS tab, runs compared by their settings against their training and validation loss)."""
    from torch.utils.tensorboard.summary import hparams, text

    events.add_summary(text("config", "```\n" + json.dumps(config, indent=2) + "\n```"), 0)
    flat = {
        f"{section}.{key}": value if isinstance(value, (int, float, str, bool)) else str(value)
        for section, keys in config.items()
        if isinstance(keys, dict)
        for key, value in keys.items()
    }
    max_loops = config.get("elr", {}).get("max_loops", 1)
    metrics = {"loss/train": 0.0, **{f"val/loss_k{k}": 0.0 for k in range(1, max_loops + 1)}}  # names only
    for summary in hparams(flat, metrics):
        events.add_summary(summary, 0)


def _wandb_run(dump_folder: Path, config: dict | None):
    """A Weights & Biases run in dump_folder/wandb, resumed under one id per folder; offline unless
    WANDB_MODE says otherwise (a cluster node rarely reaches the service; `wandb sync` uploads later)."""
    import wandb  # present: the config check (elr/config/job.py) looked for it

    run_id = hashlib.sha1(str(dump_folder.resolve()).encode()).hexdigest()[:12]
    id_file = dump_folder / "wandb_id"
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        id_file.write_text(run_id)
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "elr"),
        dir=str(dump_folder),
        id=run_id,
        resume="allow",
        config=config,
        mode=os.environ.get("WANDB_MODE", "offline"),
    )
