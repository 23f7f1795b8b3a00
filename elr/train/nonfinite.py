"""What a NaN or Inf does to a run: an update that meets one is skipped, a streak of them stops the run,
and weights that hold one are never saved."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from elr.checkpoint import first_nonfinite
from elr.train.train_state import ModelState

logger = logging.getLogger("elr")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive updates with a NaN/Inf loss or gradient norm, or weights holding NaN/Inf."""


class NonFiniteGuard:
    """Counts consecutive updates with a non-finite loss or gradient norm (training.max_nonfinite_steps)."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def allows_update(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether this update may be applied; past `limit` skipped updates in a row, NonFiniteLossError.
        Every rank sees the same (reduced) loss and norm, so every rank decides alike."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = 0
            return True
        self.streak += 1
        logger.warning(
            f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; update skipped "
            f"({self.streak} in a row, limit {self.limit})"
        )
        if self.streak > self.limit:
            raise NonFiniteLossError(
                f"{self.streak} consecutive updates had a NaN/Inf loss or gradient norm "
                f"(training.max_nonfinite_steps = {self.limit}); stopping without "
                "saving. Lower optimizer.lr or resume from the last checkpoint."
            )
        return False


def check_weights_finite(model: nn.Module, device: torch.device, step: int) -> None:
    """NonFiniteLossError if any rank's shards of the weights hold NaN/Inf (a collective)."""
    bad = torch.tensor(
        [first_nonfinite(ModelState(model).state_dict()) is not None], dtype=torch.float32, device=device
    )
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise NonFiniteLossError(
            f"step {step}: the model weights hold NaN/Inf; not saving a checkpoint of them. "
            "Lower optimizer.lr or resume from the last checkpoint."
        )
