"""Where numbers go: a console line per log step, TensorBoard scalars, metrics.jsonl, optionally W&B.

metrics.jsonl holds one JSON object per optimizer step (and per evaluation), so two runs can be
compared line by line by any tool; TensorBoard gets the same scalars under the same names. A resumed
run continues both: records past the resumed step are dropped first (elr/train/resume.py) and
TensorBoard purges its events from there, so every step appears once.

The console line and the per-loop statistics describe the logging window (every step since the
previous line, `LogWindow`), not the one step that happens to be logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
from pathlib import Path

import torch

from elr.progress import duration
from elr.train.resume import truncate_metrics

logger = logging.getLogger("elr")


def setup_lines(cfg, model, dims, device: torch.device, n_micro: int, global_batch: int) -> list[str]:
    """What a run prints before its first step: the model, and the layout and batch of an update."""
    a, t = model.args, cfg.training
    n_params = sum(p.numel() for p in model.parameters())
    n_in, n_rec, n_out = a.partition
    return [
        f"model {cfg.model.flavor}: {n_params:,} parameters | layers {a.layer_pattern} "
        f"(input {n_in}, recurrent {n_rec}, output {n_out}) | ELR {'on' if cfg.elr.enabled else 'off (baseline)'}, "
        f"update {a.update}, conditioning {'on' if a.conditioning else 'off'}, K={a.max_loops}",
        f"{dims.world_size} rank(s) on {device.type} (dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} "
        f"x cp {dims.cp} x tp {dims.tp}) | {n_micro} microbatch(es) x {t.local_batch_size} x {t.seq_len} tokens "
        f"per data-parallel rank per update | global batch {global_batch} | "
        f"{model.num_flops_per_token(t.seq_len, 1) / 1e9:.3f} GFLOP/token at k=1",
    ]


# Dense bf16 peak TFLOP/s per device, from the vendors' datasheets; the first name found in the device's
# name wins (so "H100 PCIe" before "H100").
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "GH200": 989.0, "H200": 989.0, "H100": 989.0,
               "A100": 312.0, "B200": 2250.0, "MI300X": 1307.0}


def peak_tflops(configured: float, device: torch.device) -> float | None:
    """The peak MFU is measured against: the configured one, else the device's from PEAK_TFLOPS; None
    for a device without a known peak (a CPU), whose MFU is not reported rather than shown as 0."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def outputs_line(dump_folder: Path, step: int, steps: int, tensorboard: bool, checkpoint: Path | None,
                 export: Path | None = None) -> str:
    """A run's last line: what it wrote and where, so the next command (generate, evaluate, plot) can start."""
    outputs = [str(dump_folder / "metrics.jsonl"), str(dump_folder / "config.json")]
    if tensorboard:
        outputs.append(f"TensorBoard {dump_folder / 'tb'}")
    outputs.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.enable is false)")
    if export:
        outputs.append(f"export {export}")
    return f"{'finished' if step >= steps else 'stopped'} at step {step}/{steps}; outputs: {', '.join(outputs)}"


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def throughput(tokens: int, flops: float, seconds: float, n_devices: int, peak_tflops: float | None) -> dict[str, float]:
    """Tokens/s for the job and per device, and MFU per device (none without a known peak).

    `flops` is the model's work for all `tokens` (every slot at its own k). Each device does
    flops / n_devices of it: data-parallel ranks split the tokens, tensor-parallel ranks split each
    token's FLOPs (per device = model FLOPs / tp), so MFU is the same for any layout of n_devices.
    """
    scalars = {"throughput/tokens_per_s": tokens / seconds, "throughput/tokens_per_s_per_device": tokens / seconds / n_devices}
    if peak_tflops:
        scalars["throughput/mfu_pct"] = 100 * flops / n_devices / seconds / (peak_tflops * 1e12)
    return scalars


class MetricsLogger:
    """Writes only on rank 0; every rank may call it. `start_step`: the step this session resumes
    from (0: a fresh run), whose later records a killed run may have left behind."""

    def __init__(self, dump_folder: Path, enable_tensorboard: bool, rank: int, start_step: int = 0,
                 enable_wandb: bool = False, config: dict | None = None):
        self.enabled = rank == 0
        self.writer = None
        self.jsonl = None
        self.wandb = None
        if not self.enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        dropped = truncate_metrics(dump_folder / "metrics.jsonl", start_step)
        if dropped:
            logger.info(f"metrics.jsonl: dropped {dropped} record(s) past step {start_step}, which this run redoes")
        self.jsonl = open(dump_folder / "metrics.jsonl", "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # one run in TensorBoard: events at or past the next step (a killed run's) are purged
            self.writer = SummaryWriter(str(dump_folder / "tb"), purge_step=start_step + 1 if start_step else 0)
            if config is not None and not start_step:  # a resume keeps the fresh run's record
                record_config(self.writer, config)
        if enable_wandb:
            self.wandb = _wandb_run(dump_folder, config)

    def log(self, step: int, scalars: dict[str, float], record: dict | None = None) -> None:
        """TensorBoard scalars, plus one jsonl line holding the scalars and any extra fields."""
        if not self.enabled:
            return
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        self.jsonl.write(json.dumps({"step": step, **scalars, **(record or {})}) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def record_config(writer, config: dict) -> None:
    """The run's config in TensorBoard: the whole of it as text (TEXT tab), and its keys as hparams
    (HPARAMS tab, runs compared by their settings against their training and validation loss)."""
    from torch.utils.tensorboard.summary import hparams

    writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
    flat = {f"{section}.{key}": value if isinstance(value, (int, float, str, bool)) else str(value)
            for section, keys in config.items() if isinstance(keys, dict) for key, value in keys.items()}
    max_loops = config.get("elr", {}).get("max_loops", 1)
    metrics = {"loss/train": 0.0, **{f"val/loss_k{k}": 0.0 for k in range(1, max_loops + 1)}}  # names only
    for summary in hparams(flat, metrics):
        writer.file_writer.add_summary(summary)


def _wandb_run(dump_folder: Path, config: dict | None):
    """A Weights & Biases run in dump_folder/wandb, resumed under one id per folder; offline unless
    WANDB_MODE says otherwise (a cluster node rarely reaches the service; `wandb sync` uploads later)."""
    import wandb  # present: the config check (elr/config.py) looked for it
    run_id = hashlib.sha1(str(dump_folder.resolve()).encode()).hexdigest()[:12]
    id_file = dump_folder / "wandb_id"
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        id_file.write_text(run_id)
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "elr"), dir=str(dump_folder), id=run_id,
                      resume="allow", config=config, mode=os.environ.get("WANDB_MODE", "offline"))


class LogWindow:
    """Sums since the previous console line: loss and tokens per k, loop counts, gradient norms,
    time, tokens, FLOPs, and every per-loop statistic of every slot of every step (kept on the
    device; one host transfer when the line is made)."""

    def __init__(self, max_loops: int):
        self.max_loops = max_loops
        self.reset()

    def reset(self) -> None:
        self.per_k = None  # [2, K]: summed loss, tokens per k
        self.steps = 0
        self.seconds = self.tokens = self.flops = self.grad_norm = self.k_sum = 0.0
        self.k_count = 0
        self.loops: dict[str, list] = {}  # "loop{i}/{name}" -> [tensor sum, slots in which loop i ran]

    def add(self, per_k: torch.Tensor, ks: torch.Tensor, grad_norm: float, loop_stats: dict[str, list],
            seconds: float, tokens: int, flops: float) -> None:
        self.per_k = per_k if self.per_k is None else self.per_k + per_k
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens
        self.flops += flops
        self.grad_norm += grad_norm
        self.k_sum += float(ks.sum())
        self.k_count += ks.numel()
        for name, values in loop_stats.items():
            total = torch.stack(values).float().sum()
            if name in self.loops:
                self.loops[name][0] = self.loops[name][0] + total
                self.loops[name][1] += len(values)
            else:
                self.loops[name] = [total, len(values)]

    def loop_means(self) -> dict[str, float]:
        """Each per-loop statistic's mean over the slots of the window in which that loop ran."""
        if not self.loops:
            return {}
        sums = torch.stack([v[0] for v in self.loops.values()]).tolist()
        return {name: total / v[1] for (name, v), total in zip(self.loops.items(), sums)}


def console_line(step: int, total: int, s: dict[str, float], window: LogWindow, n_devices: int,
                 peak_tflops: float | None, elapsed: float) -> str:
    """One readable line over the logging window: loss (token-weighted) per k, mean k, gradient norm,
    tokens/s and MFU are over every step since the previous line; lr is the logged step's, memory
    the peak so far; eta is the window's time per step x the steps left (validation not counted)."""
    w = window.per_k
    seen = w[1] > 0
    loss = (w[0].sum() / w[1].sum()).item()
    per_k = " ".join(f"k{k + 1} {(w[0, k] / w[1, k]).item():.4f}" for k in range(w.shape[1]) if seen[k])
    seconds = max(window.seconds, 1e-9)
    mfu = f"{100 * window.flops / n_devices / seconds / (peak_tflops * 1e12):.2f}%" if peak_tflops else "n/a"
    eta = window.seconds / window.steps * (total - step)
    return (
        f"step {step:>{len(str(total))}}/{total} | loss {loss:.4f} ({per_k}) | "
        f"mean k {window.k_sum / window.k_count:.2f} | lr {s['lr']:.2e} | gnorm {window.grad_norm / window.steps:.3f} | "
        f"{window.tokens / seconds:,.0f} tok/s | mfu {mfu} | mem {s['memory/max_gib']:.2f} GiB | "
        f"elapsed {duration(elapsed)} | eta {duration(eta)}"
    )
