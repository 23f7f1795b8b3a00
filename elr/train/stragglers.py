"""Who waits for whom: every data-parallel rank's time in the recurrent block, microbatch by microbatch.

Under FSDP the data-parallel ranks meet on every microbatch (all-gathers before each unit,
reduce-scatters after), so a rank that ran fewer loops than another idles in the next collective.
No CPU run shows that cost, so the trainer measures it where it arises: it times the recurrent block's
forward on every rank (the block and its k loops are one FSDP unit, gathered before the loops start,
and the ranks of a TP/CP/EP group run the same k, so no wait falls inside the timed span), gathers the
logging window's times over the data-parallel ranks at each log step, and reports

    wait x = sum_m max_r t[r, m] / mean_r sum_m t[r, m]

the recurrent block's share of the step at the pace of the slowest rank of each microbatch, over the
same work without waiting (forward only: backward scales with it). Beside it the trainer logs the wait
factor its draws predict (elr.train.loop_sampler.wait_factor), which needs no timing.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn


class LoopTimer:
    """Times each forward of `block` while `active`; CUDA events on GPU (read at log steps only, so
    the step never synchronises), the wall clock on CPU."""

    def __init__(self, block: nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.active = False
        self._open = None
        self._spans: list = []
        block.register_forward_pre_hook(self._start)
        block.register_forward_hook(self._end)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, module, args) -> None:
        if self.active:
            self._open = self._now()

    def _end(self, module, args, output) -> None:
        if self.active and self._open is not None:
            self._spans.append((self._open, self._now()))
            self._open = None

    def take(self) -> torch.Tensor:
        """Milliseconds of each timed forward since the last call, in order (float64, on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            ms = [start.elapsed_time(end) for start, end in self._spans]
        else:
            ms = [(end - start) * 1e3 for start, end in self._spans]
        self._spans = []
        return torch.tensor(ms, dtype=torch.float64)


def measured_wait(ms: torch.Tensor, group=None, device: torch.device | None = None) -> dict[str, float]:
    """Gather each rank's per-microbatch times (the same count on every rank: one per microbatch) over
    the data-parallel group; the wait factor and the mean and largest time a rank idled, in ms per
    timed microbatch. One process: nothing to wait for."""
    if group is None or dist.get_world_size(group) == 1 or ms.numel() == 0:
        return {"wait_measured": 1.0, "idle_ms_mean": 0.0, "idle_ms_max": 0.0}
    local = ms.to(device or ms.device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    times = torch.stack(gathered).double().cpu()  # [ranks, microbatches]
    slowest = times.max(0).values
    idle = (slowest - times).sum(1) / times.shape[1]
    return {
        "wait_measured": (slowest.sum() / times.sum(1).mean()).item(),
        "idle_ms_mean": idle.mean().item(),
        "idle_ms_max": idle.max().item(),
    }
