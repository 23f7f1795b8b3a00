"""A slot pool: the rows of one static decode state, each holding one choice between decoding steps.

Requests join and leave between steps (iteration-level batching, as Orca and vLLM schedule): a new
request's prompts are prefilled in a cache of their own, left-padded into one batch, and each choice's
row is copied into a free slot by index (`StaticCache.load_row`: its columns where they were, each row
keeping its own length); a finished choice frees its slot. One forward per step decodes every slot
(elr/infer/decode.py's DecodeStep, compiled with `compile`, else the same forward eagerly): a budget pool
passes each row's own k (rows of different k in one forward, a per-row LoopBudget, the largest busy k as
the step's loop cap), an adaptive pool the cap K and its exit rule (which takes one loop count, so
"auto" requests have a pool of their own). Free slots ride along as inactive rows: on a CPU a batch costs
about what one row does; an engine for accelerators would pack the busy rows. Attention reads the columns
up to the longest busy row's, in powers of two (`capacity_for`; a compiled step has a graph per such
window and loop cap). The memory is fixed at start: rows x one request's state at the full context
(elr/infer/memory.py), plus a prefill's cache while a batch of prompts is read.
"""

from __future__ import annotations

import torch

from elr.infer.decode import DecodeStep, capacity_for
from elr.infer.generate import left_pad
from elr.infer.static_cache import StaticCache
from elr.models.budget import LoopBudget, as_loop_budget
from elr.models.early_exit import ExitRule


class SlotPool:
    def __init__(
        self,
        model,
        rows: int,
        max_loops: int,
        kv_mode: str,
        exit_rule: ExitRule | None = None,
        compile: bool | DecodeStep = False,
    ):
        """`max_loops`: the cap K, the most loops any row runs (an adaptive pool runs every row at it).
        `compile`: decode through the compiled step (or this DecodeStep; the same tokens)."""
        self.model, self.max_loops, self.kv_mode, self.exit_rule = model, max_loops, kv_mode, exit_rule
        self.cache = StaticCache(model, rows, model.args.max_seq_len, max_loops, kv_mode)
        for row in range(rows):
            self.cache.release_row(row)
        self.decode = compile if isinstance(compile, DecodeStep) else DecodeStep(model, compile=compile)
        self.free = list(range(rows))
        self.busy: dict[int, tuple[object, object]] = {}  # row -> (request, sequence)
        self.lengths: dict[int, int] = {}  # busy row -> the columns it holds (kept here: nothing is read back)

    @property
    def rows(self) -> int:
        return self.cache.batch

    def prefill(self, prompts: list[list[int]], budgets: list[int]) -> tuple[torch.Tensor, StaticCache]:
        """Read prompts (one k each; the cap in an adaptive pool) in a cache of their own: (the next-token
        logits [len(prompts), vocab], that cache, whose rows `join` copies into slots)."""
        device = self.cache.lengths.device
        tokens, pad = left_pad(prompts, 0, device)
        cache = StaticCache(self.model, len(prompts), tokens.shape[1], self.max_loops, self.kv_mode)
        cache.start.copy_(pad)
        loops = self.max_loops if self.exit_rule is not None else as_loop_budget(budgets, len(prompts), device)
        return self.model(tokens, loops, cache)[:, -1], cache

    def join(self, prefill: StaticCache, prefill_row: int, request, sequence) -> None:
        """Copy a prefilled row into a free slot, its columns where they were."""
        row = self.free.pop(0)
        self.cache.load_row(row, prefill, prefill_row)
        self.lengths[row] = prefill.capacity  # every prefilled row ends at the prefill's last column
        self.busy[row] = (request, sequence)
        sequence.row = row

    def leave(self, row: int) -> None:
        request, sequence = self.busy.pop(row)
        del self.lengths[row]
        sequence.row = None
        self.cache.release_row(row)
        self.free.append(row)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each busy row its last token: (next-token logits [rows, vocab], the loops each row ran)."""
        device = self.cache.lengths.device
        self.cache.window = capacity_for(max(self.lengths.values()) + 1, self.model)
        tokens = torch.zeros(self.rows, 1, dtype=torch.long, device=device)
        for row, (_, sequence) in self.busy.items():
            tokens[row, 0] = sequence.tokens[-1]
        for row in self.lengths:
            self.lengths[row] += 1
        if self.exit_rule is not None:
            logits = self.decode(self.cache, tokens, self.max_loops, exit_rule=self.exit_rule)[:, -1]
            return logits, self.model.loops_used()[:, 0]
        cap = max(request.loops for request, _ in self.busy.values())
        per_row = [cap] * self.rows  # free rows: no extra loop
        for row, (request, _) in self.busy.items():
            per_row[row] = request.loops
        budgets: LoopBudget = as_loop_budget(per_row, self.rows, device)
        return self.decode(self.cache, tokens, budgets, cap)[:, -1], budgets
