"""A slot pool: the rows of one inference cache, each holding one choice between decoding steps.

Requests join and leave between steps (iteration-level batching, as Orca and vLLM schedule): a new
request's prompts are prefilled in a cache of their own, left-padded into one batch, and each choice's
row is copied into a free slot (`InferenceCache.load_row`), ending at the column every row shares; a
finished choice frees its slot. One forward per step decodes every slot: a budget pool passes each
row's own k (rows of different k in one forward, a per-row LoopBudget), an adaptive pool the cap K
and its exit rule (which takes one loop count, so "auto" requests have a pool of their own). Free
slots ride along as rows of padding: on a CPU a batch costs about what one row does; an engine for
accelerators would pack the busy rows. When the shared column reaches the capacity, every row's
columns move left by the padding all rows have (`move_columns`), so each request may use the whole
context; they move left too when a row joins while at least half the columns are such padding (every
step's attention reads all columns). The memory is fixed at start: rows x one request's state at the full context
(elr/infer/memory.py), plus a prefill's cache while a batch of prompts is read.
"""

from __future__ import annotations

import torch

from elr.infer.cache import InferenceCache
from elr.infer.generate import left_pad
from elr.models.budget import LoopBudget, as_loop_budget
from elr.models.early_exit import ExitRule


class SlotPool:
    def __init__(self, model, rows: int, max_loops: int, kv_mode: str, exit_rule: ExitRule | None = None):
        """`max_loops`: the cap K, the most loops any row runs (an adaptive pool runs every row at it)."""
        self.model, self.max_loops, self.kv_mode, self.exit_rule = model, max_loops, kv_mode, exit_rule
        self.cache = InferenceCache(model, rows, model.args.max_seq_len, max_loops, kv_mode)
        for row in range(rows):
            self.cache.release_row(row)
        self.free = list(range(rows))
        self.busy: dict[int, tuple[object, object]] = {}  # row -> (request, sequence)

    @property
    def rows(self) -> int:
        return self.cache.batch

    def prefill(self, prompts: list[list[int]], budgets: list[int]) -> tuple[torch.Tensor, InferenceCache]:
        """Read prompts (one k each; the cap in an adaptive pool) in a cache of their own: (the next-token
        logits [len(prompts), vocab], that cache, whose rows `join` copies into slots)."""
        device = self.cache.pad.device
        tokens, pad = left_pad(prompts, 0, device)
        cache = InferenceCache(self.model, len(prompts), tokens.shape[1], self.max_loops, self.kv_mode, pad)
        loops = self.max_loops if self.exit_rule is not None else as_loop_budget(budgets, len(prompts), device)
        return self.model(tokens, loops, cache)[:, -1], cache

    def join(self, prefill: InferenceCache, prefill_row: int, request, sequence) -> None:
        """Copy a prefilled row into a free slot, moving every row's columns right if it is longer than
        the columns cached (and left first when at least half of them are padding to every row: the
        attention of every step reads all columns)."""
        row = self.free.pop(0)
        if 2 * self.shared_padding() >= self.cache.length:
            self.cache.move_columns(-self.shared_padding())
        need = prefill.length - int(prefill.pad[prefill_row])
        if need > self.cache.length:
            self.cache.move_columns(need - self.cache.length)
        self.cache.load_row(row, prefill, prefill_row)
        self.busy[row] = (request, sequence)
        sequence.row = row

    def leave(self, row: int) -> None:
        request, sequence = self.busy.pop(row)
        sequence.row = None
        self.cache.release_row(row)
        self.free.append(row)

    def shared_padding(self) -> int:
        """The leading columns no busy row reads (all of them when no row is busy)."""
        if not self.busy:
            return self.cache.length
        return int(self.cache.pad[torch.tensor(list(self.busy), device=self.cache.pad.device)].min())

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each busy row its last token: (next-token logits [rows, vocab], the loops each row ran)."""
        if self.cache.length == self.cache.capacity:  # every busy row has room left, so some columns are padding
            self.cache.move_columns(-self.shared_padding())
        device = self.cache.pad.device
        tokens = torch.zeros(self.rows, 1, dtype=torch.long, device=device)
        for row, (_, sequence) in self.busy.items():
            tokens[row, 0] = sequence.tokens[-1]
        if self.exit_rule is not None:
            logits = self.model(tokens, self.max_loops, self.cache, exit_rule=self.exit_rule)[:, -1]
            return logits, self.model.loops_used()[:, 0]
        per_row = [max(request.loops for request, _ in self.busy.values())] * self.rows  # free rows: no extra loop
        for row, (request, _) in self.busy.items():
            per_row[row] = request.loops
        budgets: LoopBudget = as_loop_budget(per_row, self.rows, device)
        return self.model(tokens, budgets, self.cache)[:, -1], budgets
