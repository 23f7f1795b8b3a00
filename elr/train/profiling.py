"""torch.profiler traces every N steps, and a CUDA memory snapshot, as torchtitan's [profiling] does.

Traces go to `dump_folder/<profiling.save_traces_folder>/iteration_<step>/rank<r>_trace.json` (open
them in Perfetto or chrome://tracing); each covers one step after a few warm-up steps. The memory
snapshot (CUDA only: torch.cuda.memory's allocation history) goes to
`dump_folder/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle` every N
steps; drag it into https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

logger = logging.getLogger("elr")

ACTIVE_STEPS = 1  # steps traced per profile_freq


class Profiler:
    """A context around the training loop; call `step(step)` after each optimizer step."""

    def __init__(self, cfg, dump_folder: Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_dir = dump_folder / cfg.save_traces_folder
        self.snapshot_dir = dump_folder / cfg.save_memory_snapshot_folder
        self.profiler = None
        self.snapshot = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and not self.snapshot:
            logger.warning("profiling.enable_memory_snapshot: needs CUDA; no memory snapshot on %s", device.type)
        self._step = 0

    def __enter__(self) -> Profiler:
        freq = self.cfg.profile_freq
        if self.cfg.enable_profiling:
            warmup = min(3, freq - 1 - ACTIVE_STEPS) if freq > 2 else 0
            wait = freq - warmup - ACTIVE_STEPS
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                on_trace_ready=self._save_trace,
                schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=ACTIVE_STEPS),
            )
            self.profiler.__enter__()
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        return self

    def step(self, step: int) -> None:
        self._step = step
        if self.profiler is not None:
            self.profiler.step()
        if self.snapshot and step % self.cfg.profile_freq == 0:
            self._save_snapshot(step)

    def _save_trace(self, prof) -> None:
        folder = self.trace_dir / f"iteration_{self._step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        logger.info(f"profiling: trace of step {self._step} written to {path}")

    def _save_snapshot(self, step: int) -> None:
        folder = self.snapshot_dir / f"iteration_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"profiling: CUDA memory snapshot of step {step} written to {path}")

    def __exit__(self, *exc) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(*exc)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
