"""The loop budget: how many times the recurrent block runs, for the whole batch or for each row.

`LoopBudget` is what `model(tokens, loops=...)` takes, under that name wherever a budget is passed on
(elr/infer, elr/serve, elr/rl): an int k, every row at k; or a LongTensor [B] of one k per row (mixed
budgets in one batch: the forward runs the largest, and each row gets exactly what it gets alone,
RecurrentBlock.elastic_forward). `as_loop_budget` turns what a caller holds (an int, a list of ints, a
tensor) into that form and checks it against the batch; `budget_range` gives the fewest and the most
loops a budget runs. A cache's and a server's loop cap (the most loops any forward through them runs)
is a plain int.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TypeAlias

import torch

LoopBudget: TypeAlias = int | torch.Tensor


def as_loop_budget(loops: int | Sequence[int] | torch.Tensor, rows: int, device=None) -> LoopBudget:
    """`loops` as the model takes it, for a batch of `rows`: an int as it is; one k per row (a list or
    a tensor) as a LongTensor [rows] (on `device` where given; a LongTensor already there is returned
    as it is)."""
    if not isinstance(loops, (torch.Tensor, Sequence)):
        return operator.index(loops)  # an int (numpy's too, as a Python int)
    if torch.is_tensor(loops) and (loops.is_floating_point() or loops.dtype == torch.bool):
        raise ValueError(f"a loop budget holds whole loop counts, not {loops.dtype}")
    budget = torch.as_tensor(loops, dtype=torch.long, device=device)
    if budget.shape != (rows,):
        counts = budget.shape[0] if budget.ndim == 1 else tuple(budget.shape)
        raise ValueError(f"{counts} loop counts for a batch of {rows}; give one per row or one int for all")
    return budget


def budget_range(loops: LoopBudget) -> tuple[int, int]:
    """(the fewest, the most) loops a row runs under `loops` (a per-row budget is read to the host in one
    transfer)."""
    if torch.is_tensor(loops):
        least, most = torch.stack(torch.aminmax(loops)).tolist()
        return least, most
    return loops, loops
