"""Where numbers go: a console line per log step, TensorBoard scalars, and metrics.jsonl.

metrics.jsonl holds one JSON object per optimizer step (and per evaluation), so two runs can be
compared line by line by any tool; TensorBoard gets the same scalars under the same names.
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path

import torch

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


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def throughput(tokens: int, flops: float, seconds: float, n_devices: int, peak_tflops: float) -> dict[str, float]:
    """Tokens/s for the job and per device, and MFU per device.

    `flops` is the model's work for all `tokens` (every slot at its own k). Each device does
    flops / n_devices of it: data-parallel ranks split the tokens, tensor-parallel ranks split each
    token's FLOPs (per device = model FLOPs / tp), so MFU is the same for any layout of n_devices.
    """
    return {
        "throughput/tokens_per_s": tokens / seconds,
        "throughput/tokens_per_s_per_device": tokens / seconds / n_devices,
        "throughput/mfu_pct": 100 * flops / n_devices / seconds / (peak_tflops * 1e12),
    }


class MetricsLogger:
    """Writes only on rank 0; every rank may call it."""

    def __init__(self, dump_folder: Path, enable_tensorboard: bool, rank: int):
        self.enabled = rank == 0
        self.writer = None
        self.jsonl = None
        if not self.enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(dump_folder / "metrics.jsonl", "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(dump_folder / "tb"))

    def log(self, step: int, scalars: dict[str, float], record: dict | None = None) -> None:
        """TensorBoard scalars, plus one jsonl line holding the scalars and any extra fields."""
        if not self.enabled:
            return
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        self.jsonl.write(json.dumps({"step": step, **scalars, **(record or {})}) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def console_line(step: int, total: int, s: dict[str, float], window: torch.Tensor) -> str:
    """One readable line; losses are token-weighted means since the previous line.

    window: [2, K] summed loss and token count per loop count k.
    """
    seen = window[1] > 0
    loss = (window[0].sum() / window[1].sum()).item()
    per_k = " ".join(
        f"k{k + 1} {(window[0, k] / window[1, k]).item():.4f}" for k in range(window.shape[1]) if seen[k]
    )
    return (
        f"step {step:>{len(str(total))}}/{total} | loss {loss:.4f} ({per_k}) | "
        f"mean k {s['loops/mean']:.2f} | lr {s['lr']:.2e} | gnorm {s['grad_norm']:.3f} | "
        f"{s['throughput/tokens_per_s']:,.0f} tok/s | mfu {s['throughput/mfu_pct']:.2f}% | "
        f"mem {s['memory/max_gib']:.2f} GiB"
    )
