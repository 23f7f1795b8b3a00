"""Preemption: SIGTERM or Ctrl-C asks the run to stop at the end of the current step.

The trainer then saves a checkpoint (when checkpoints are on) and exits 0; a second signal stops at
once (the default handler is back). Whether to stop is decided by all ranks together, so a signal
that reached one rank stops every rank after the same step.
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

logger = logging.getLogger("elr")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        logger.warning(f"received {signal.Signals(signum).name}: {action} at the end of this step")
        self.requested = True
        signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once

    def now(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it after each step)."""
        flag = torch.tensor([float(self.requested)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
