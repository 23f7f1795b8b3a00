"""Preemption: SIGTERM or Ctrl-C asks the run to stop at the end of the current step.

The trainer then saves a checkpoint (when checkpoints are on) and exits 0. A second signal stops at
once: it raises `Interrupted` (elr/console/interrupt.py) wherever the run is, a save in progress
removes its partial folder, the lock is released, and train.py says in one line which checkpoint the
same command resumes from. Whether to stop after a step is decided by all ranks together, so a signal
that reached one rank stops every rank after the same step.
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

from elr.console.interrupt import SIGNALS, Interrupted, interrupt_now

logger = logging.getLogger("elr")


class StopOnSignal:
    """Installs the handlers for the duration of a `with` block (the previous ones come back after)."""

    def __init__(self, device: torch.device, saves: bool):
        self.device, self.saves = device, saves
        self.requested = False
        self._previous: dict = {}

    def __enter__(self) -> StopOnSignal:
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        action = "saving a checkpoint" if self.saves else "stopping (checkpoint.enable is false: no save)"
        logger.warning(
            f"received {signal.Signals(signum).name}: {action} at the end of this step (a second signal stops at once)"
        )
        self.requested = True
        for s in SIGNALS:  # a second signal, of either kind, stops at once
            signal.signal(s, interrupt_now)

    def now(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it after each step)."""
        flag = torch.tensor([float(self.requested)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def interrupted_line(e: Interrupted, step: int, checkpoints: bool, newest: int | None) -> str:
    """train.py's one line for a run stopped at once (a second signal): where it stood and what the same
    command does. `step`: the last step trained; `newest`: the newest committed checkpoint, read once the
    interrupted save removed its partial folder."""
    where = f"stopped at once by {e.name} after step {step}"
    if not checkpoints:
        return f"{where}, without saving (checkpoint.enable is false)"
    if newest is None:
        return f"{where}; no checkpoint was committed, so the same command starts this run again from step 0"
    return f"{where}; the same command resumes from checkpoint step-{newest}"
