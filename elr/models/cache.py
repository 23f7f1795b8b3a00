"""The inference cache's interface: what the model and its layers' cache entries ask of a cache.

A forward with a cache (`model(tokens, loops, cache)`) continues the cached sequences: it asks the
cache for the fewest and most loops it runs (`loop_range`) and each row's positions (`begin`), hands
every layer that keeps state its entry at loop i (`entry`), tells it which rows the running loop counts
for (`set_rows`: rows past their budget or exit keep what they held) and ends the forward (`advance`).
The entries (each layer kind's `InferenceState`, elr/models/kinds.py: attention's keys and values, GDP's
states) read the cache's masks below and write columns through `store`, so where a row's columns sit is
the cache's business. Two caches implement it: elr/infer/cache.py's InferenceCache (one column index
shared by every row, the eager reference) and elr/infer/static_cache.py's StaticCache (a column index
per row, every shape fixed, for the compiled decode step). The models import only this Protocol, so
they never import inference (tests/test_layering.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from elr.models.budget import LoopBudget


@runtime_checkable
class Cache(Protocol):
    batch: int  # rows
    capacity: int  # the columns a row can hold
    rows: torch.Tensor | None  # [B] bool: the rows whose results the running loop stores (None: every row)
    valid: torch.Tensor | None  # [B, chunk] bool: the running chunk's real columns (False: left padding)
    films: (
        object | None
    )  # the loop conditioning's FiLM per (loop, budget), precomputed (LoopConditioning.table), or None
    attn_mask: torch.Tensor | None  # [B, 1, chunk, columns] bool: the columns `store` returns that each new column sees

    def loop_range(self, loops: LoopBudget) -> tuple[int, int]:
        """(the fewest, the most) loops a forward at `loops` runs, as Python ints (a compiled forward
        reads them without reading the budget tensor back)."""
        ...

    def begin(self, chunk: int, loops: LoopBudget) -> torch.Tensor:
        """Start a forward over `chunk` new columns at `loops`; returns each row's positions [B, chunk]."""
        ...

    def entry(self, layer: nn.Module, loop: int) -> object | None:
        """What `layer` keeps at loop `loop` (the object its sublayer's forward takes as `cache`); None
        for a kind that keeps nothing."""
        ...

    def store(self, buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write the running chunk's `values` [B, H, chunk, D] into its columns of `buffer` [B, H, capacity,
        D] (an entry's keys or values; rows outside `rows` keep what they held); returns the columns the
        chunk attends to, those `attn_mask` describes."""
        ...

    def set_rows(self, rows: torch.Tensor | None, loop: int | None = None) -> None:
        """The recurrent block's running `loop` counts only for `rows` ([B] bool; None: every row)."""
        ...

    def advance(self) -> None:
        """The forward is done: commit what the entries held back and count its columns as cached."""
        ...
