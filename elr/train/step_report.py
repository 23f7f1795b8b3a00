"""What each training step reports: FLOPs and MFU, memory, the logging window and the console line.

`Trainer.train_step` returns a `StepStats`; `StepReporter.report` turns it into the step's metrics
record (metrics.jsonl, TensorBoard, W&B through elr/train/metrics.py) and, every `metrics.log_freq`
steps, one console line. The console line and the per-loop statistics describe the logging window
(every step since the previous line, `LogWindow`), not the one step that happens to be logged.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elr.config import JobConfig
from elr.console.progress import duration
from elr.train.metrics import MetricsLogger, peak_tflops
from elr.train.stragglers import measured_wait

logger = logging.getLogger("elr")


@dataclass
class StepStats:
    """What one optimizer step measured (`Trainer.train_step`)."""

    scalars: dict[str, float]  # loss, loss per k, grad norm, lr, mean k, MoE load: the step's metrics
    ks: torch.Tensor  # [data-parallel ranks, microbatches]: the loop count of every slot
    per_k: torch.Tensor  # [2, K]: summed loss and scored tokens per k, over every rank
    loop_stats: dict[str, list[torch.Tensor]]  # "loop{i}/{name}" -> one value per slot that ran loop i, on the device
    every_loop: bool  # the loss was taken at every loop's exit (the output block and head ran k times)


class StepReporter:
    """Owns the logging window: each step's FLOPs, throughput and memory go into its metrics record,
    and every `metrics.log_freq` steps (and the first and last) the window's means into the record
    and one console line."""

    def __init__(
        self,
        cfg: JobConfig,
        metrics: MetricsLogger,
        world_size: int,
        device: torch.device,
        tokens_per_update: int,
        loop_timer=None,
    ):
        """loop_timer: returns the model's LoopTimer (elr/train/stragglers.py; a new one after the late
        switch rebuilds the model), whose times are gathered over the ranks at each console line."""
        self.cfg, self.metrics, self.world_size, self.device = cfg, metrics, world_size, device
        self.loop_timer = loop_timer
        self.peak_tflops = peak_tflops(cfg.metrics.peak_tflops, device)  # None: MFU not reported (a CPU)
        self.tokens_per_update = tokens_per_update
        self.window = LogWindow()
        self.session_start = time.perf_counter()

    def report(self, step: int, stats: StepStats, seconds: float, model, tokens_seen: int) -> None:
        """Log step `step`, which took `seconds`, ran `model` and brought the run to `tokens_seen` tokens."""
        t, m = self.cfg.training, self.cfg.metrics
        flops = sum(model.num_flops_per_token(t.seq_len, k, stats.every_loop) for k in stats.ks.flatten().tolist())
        flops *= t.local_batch_size * t.seq_len
        self.window.add(stats, seconds, self.tokens_per_update, flops)
        scalars = stats.scalars
        scalars.update(throughput(self.tokens_per_update, flops, seconds, self.world_size, self.peak_tflops))
        scalars["memory/max_gib"] = memory_gib(self.device)
        line = step % m.log_freq == 0 or step == 1 or step == t.steps
        if line:  # per-loop statistics: the window's means, for every loop that ran in it
            scalars.update(self.window.loop_means())
            scalars["loops/wait_expected_window"] = self.window.wait_expected / self.window.steps
            if self.loop_timer is not None:
                times = self.loop_timer().take()
                if dist.is_initialized() and self.world_size > 1:  # a collective on every rank at the same steps
                    waits = measured_wait(times, dist.group.WORLD, self.device)
                    scalars.update({f"loops/{name}": value for name, value in waits.items()})
        self.metrics.log(step, scalars, {"loops": stats.ks.tolist(), "tokens": tokens_seen})
        if line:
            logger.info(
                console_line(
                    step,
                    t.steps,
                    scalars,
                    self.window,
                    self.world_size,
                    self.peak_tflops,
                    time.perf_counter() - self.session_start,
                )
            )
            self.window.reset()


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def throughput(
    tokens: int, flops: float, seconds: float, n_devices: int, peak_tflops: float | None
) -> dict[str, float]:
    """Tokens/s for the job and per device, and MFU per device (none without a known peak).

    `flops` is the model's work for all `tokens` (every slot at its own k). Each device does
    flops / n_devices of it: data-parallel ranks split the tokens, tensor-parallel ranks split each
    token's FLOPs (per device = model FLOPs / tp), so MFU is the same for any layout of n_devices.
    """
    scalars = {
        "throughput/tokens_per_s": tokens / seconds,
        "throughput/tokens_per_s_per_device": tokens / seconds / n_devices,
    }
    if peak_tflops:
        scalars["throughput/mfu_pct"] = 100 * flops / n_devices / seconds / (peak_tflops * 1e12)
    return scalars


class LogWindow:
    """Sums since the previous console line: loss and tokens per k, loop counts, gradient norms,
    time, tokens, FLOPs, and every per-loop statistic of every slot of every step (kept on the
    device; one host transfer when the line is made)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.per_k = None  # [2, K]: summed loss, tokens per k
        self.steps = 0
        self.seconds = self.tokens = self.flops = self.grad_norm = self.k_sum = self.wait_expected = 0.0
        self.k_count = 0
        self.loops: dict[str, list] = {}  # "loop{i}/{name}" -> [tensor sum, slots in which loop i ran]

    def add(self, stats: StepStats, seconds: float, tokens: int, flops: float) -> None:
        self.per_k = stats.per_k if self.per_k is None else self.per_k + stats.per_k
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens
        self.flops += flops
        self.grad_norm += stats.scalars["grad_norm"]
        self.wait_expected += stats.scalars.get("loops/wait_expected", 1.0)
        self.k_sum += float(stats.ks.sum())
        self.k_count += stats.ks.numel()
        for name, values in stats.loop_stats.items():
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


def wait_text(s: dict[str, float]) -> str:
    """The window's waiting, where there is any to see: measured over the ranks (several processes)
    beside what the draws predict, or the prediction alone (a process emulating ranks)."""
    expected = s.get("loops/wait_expected_window", 1.0)
    if "loops/wait_measured" in s and s.get("loops/idle_ms_max", 0.0) > 0:
        return f"wait {s['loops/wait_measured']:.2f}x (draws {expected:.2f}x) | "
    return f"wait {expected:.2f}x (draws) | " if expected > 1.0 + 1e-9 else ""


def console_line(
    step: int, total: int, s: dict[str, float], window: LogWindow, n_devices: int, peak: float | None, elapsed: float
) -> str:
    """One readable line over the logging window: loss (token-weighted) per k, mean k, gradient norm,
    tokens/s and MFU are over every step since the previous line; lr is the logged step's, memory
    the peak so far; eta is the window's time per step x the steps left (validation not counted)."""
    w = window.per_k
    seen = w[1] > 0
    loss = (w[0].sum() / w[1].sum()).item()
    per_k = " ".join(f"k{k + 1} {(w[0, k] / w[1, k]).item():.4f}" for k in range(w.shape[1]) if seen[k])
    seconds = max(window.seconds, 1e-9)
    mfu = f"{100 * window.flops / n_devices / seconds / (peak * 1e12):.2f}%" if peak else "n/a"
    eta = window.seconds / window.steps * (total - step)
    return (
        f"step {step:>{len(str(total))}}/{total} | loss {loss:.4f} ({per_k}) | "
        f"mean k {window.k_sum / window.k_count:.2f} | lr {s['lr']:.2e} | "
        f"gnorm {window.grad_norm / window.steps:.3f} | "
        f"{wait_text(s)}{window.tokens / seconds:,.0f} tok/s | mfu {mfu} | mem {s['memory/max_gib']:.2f} GiB | "
        f"elapsed {duration(elapsed)} | eta {duration(eta)}"
    )
