"""The compiled decode step: the model's own forward over a StaticCache, compiled once per shape.

Eager decoding runs one Python-level forward per token: k loops of every recurrent layer, per-loop
cache entries and per-row budget masks, each a handful of small kernel launches, so on a small model
the time per token is mostly launch and interpreter overhead (gpt-fast's observation for plain
transformers, more so for a looped one). `DecodeStep` compiles `model(tokens, budgets, cache)` with
`torch.compile(fullgraph=True)` over a StaticCache (elr/infer/static_cache.py: fixed shapes, in-place
updates), on CUDA with `mode="reduce-overhead"` (CUDA graphs). What stays data, so one graph serves
every batch composition: the tokens, each row's loop budget (a LongTensor [B]; rows past their budget
are masked, never branched on), each row's length and start, which rows are free. What a graph is
built for: the loop cap (the most loops any row runs, so a batch at k = 1 does not pay for K loops),
the chunk width (1 for decoding; a verify's n + 1; a prefill's width, prompts left-padded to a power of
two by `prefill_width`), the batch and capacity, the KV mode and an exit rule: a handful of graphs per
process, each compiled on first use (`warm_up` compiles them ahead). The eager path (InferenceCache,
elr/infer/cache.py) stays the reference the tests hold this one to, token for token.

Compiling costs seconds to minutes on a CPU, once: inductor keeps its outputs in TORCHINDUCTOR_CACHE_DIR
(`use_compile_cache` points it under outputs/ for the scripts), so later processes load them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from elr.infer.static_cache import StaticCache
from elr.models.budget import LoopBudget
from elr.models.early_exit import ExitRule

# Graphs one process may build for the decode step before torch.compile falls back to eager: caps 1..K,
# a few chunk widths and batch geometries, exit rules, several models in one test session.
RECOMPILE_LIMIT = 64
SMALLEST_CAPACITY = 64  # caches are sized in powers of two from this, so prompts of nearby lengths share a graph
SMALLEST_PREFILL = 16  # a compiled prefill left-pads its prompts to a power of two from this (a graph per width)


# Decoding steps (forwards of one token per row) from which compiling pays for itself, by device type: the
# compile's time over what a step saves. CPU, measured (docs/benchmarks.md#decoding, the 2-core machine): a
# cold first call takes 33-62 s; a step saves 3.0 ms at batch 1 and 4.1 ms at batch 64 (k = 4), so about
# 15,000-20,000 steps. CUDA: an estimate until scripts/gpu_check.sh runs (CUDA graphs save the launch
# overhead that dominates a small decode step).
COMPILE_PAYS_AFTER = {"cpu": 20_000, "cuda": 2000}


def compile_pays(steps: int, device) -> bool:
    """Whether `steps` decoding forwards on `device` are enough to pay for compiling the step."""
    return steps >= COMPILE_PAYS_AFTER.get(torch.device(device).type, COMPILE_PAYS_AFTER["cpu"])


def _forward(
    model, cache: StaticCache, tokens: torch.Tensor, budgets: torch.Tensor, exit_rule: ExitRule | None, last: bool
):
    if last:  # a prompt read for its next token: the head on the last column only
        return model.output(model(tokens, budgets, cache, head=False, exit_rule=exit_rule)[:, -1:])
    return model(tokens, budgets, cache, exit_rule=exit_rule)


def _draft(model, cache: StaticCache, token: torch.Tensor, budgets: torch.Tensor, n: int) -> torch.Tensor:
    """`n` greedy tokens per row, each fed back in: [B, n] (self-speculative drafts, one call for all)."""
    drafted = []
    for _ in range(n):
        token = model(token, budgets, cache)[:, -1].argmax(-1, keepdim=True)
        drafted.append(token)
    return torch.cat(drafted, 1)


def graphs_built() -> int:
    """Graphs dynamo has built in this process so far: a call that raised it compiled (its time is no step's)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def use_compile_cache(folder: str | Path = "outputs/inductor-cache") -> None:
    """Keep inductor's compiled kernels in `folder` (unless TORCHINDUCTOR_CACHE_DIR is set already), so a
    cold compile is paid once per machine, not once per process."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(folder).resolve()))


def capacity_for(columns: int, model) -> int:
    """A cache capacity of at least `columns`: the next power of two from SMALLEST_CAPACITY, within the
    model's positions (a few capacities, so a few graphs, where a growing chat would build one per length;
    attention reads the whole capacity, at most twice what it needs)."""
    rounded = max(SMALLEST_CAPACITY, 1 << (columns - 1).bit_length())
    return max(columns, min(rounded, model.args.max_seq_len))


def prefill_width(longest: int, limit: int) -> int:
    """The width a batch of prompts whose longest has `longest` tokens is left-padded to for a compiled
    prefill: the next power of two from SMALLEST_PREFILL, so prompts of nearby lengths share a graph (padding
    columns are masked: positions count from each row's start), within `limit` columns (the context left
    after the new tokens), never below `longest`."""
    rounded = max(SMALLEST_PREFILL, 1 << (longest - 1).bit_length())
    return max(longest, min(rounded, limit))


class DecodeStep:
    """`step(cache, tokens, budgets, cap)`: the logits [B, T, vocab] of feeding `tokens` [B, T] to every row
    of `cache` at per-row `budgets` [B] (or one k, made a per-row budget: one graph for every mix), running
    at most `cap` loops; the cache advances in place. With an exit rule, `budgets` is its one cap.
    compile=False runs the same forward eagerly (a StaticCache's eager reference); `backend` "aot_eager"
    traces and functionalises the step as inductor would without generating code (the cheap tests)."""

    def __init__(self, model, compile: bool = True, backend: str = "inductor"):
        self.model, self.compiled = model, compile
        self._forward, self._draft = _forward, _draft
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            cuda = model.output.weight.is_cuda
            mode = "reduce-overhead" if cuda and backend == "inductor" else None
            self._forward = torch.compile(_forward, fullgraph=True, dynamic=False, backend=backend, mode=mode)
            self._draft = torch.compile(_draft, fullgraph=True, dynamic=False, backend=backend, mode=mode)

    @torch.no_grad()
    def __call__(
        self,
        cache: StaticCache,
        tokens: torch.Tensor,
        budgets: LoopBudget,
        cap: int | None = None,
        exit_rule: ExitRule | None = None,
        last: bool = False,
    ) -> torch.Tensor:
        """Logits [B, chunk, vocab] of `tokens` fed through `cache` at `budgets`; with `last`, of the last
        column only [B, 1, vocab] (a prefill whose other columns' logits nobody reads: at 64 prompts of 32
        tokens and a vocabulary of 8K the head on every column is a fifth of the prefill)."""
        if exit_rule is not None:  # adaptive depth: one loop count, the cap
            if torch.is_tensor(budgets):
                raise ValueError("an exit rule caps every row at one k: give one loop count")
            cap = budgets
        elif not torch.is_tensor(budgets):
            cap = budgets if cap is None else cap
            budgets = torch.full((cache.batch,), budgets, dtype=torch.long, device=tokens.device)
        elif cap is None:
            raise ValueError("a per-row budget needs its cap (the most loops any row runs) to pick its graph")
        self._begin(cache, tokens, cap)
        return self._forward(self.model, cache, tokens, budgets, exit_rule, last)

    @torch.no_grad()
    def draft(self, cache: StaticCache, token: torch.Tensor, loops: int, n: int) -> torch.Tensor:
        """`n` greedy tokens per row from `token` [B, w] at `loops` (the first after the w columns), each fed
        back but the last, in one call (one graph per w, one read-back): [B, n]; the cache advances by
        w + n - 1 columns (self-speculative drafts, rewound after)."""
        self._begin(cache, token, loops)
        budgets = torch.full((cache.batch,), loops, dtype=torch.long, device=token.device)
        return self._draft(self.model, cache, token, budgets, n)

    def _begin(self, cache: StaticCache, tokens: torch.Tensor, cap: int) -> None:
        if not 1 <= cap <= cache.max_loops:
            raise ValueError(f"this cache was built for at most k={cache.max_loops}, not k={cap}")
        cache.loop_cap = cap
        if self.compiled and tokens.is_cuda:
            if not cache.static_marked:
                cache.mark_static()
            torch.compiler.cudagraph_mark_step_begin()

    def warm_up(self, cache: StaticCache, caps, chunk: int = 1, exit_rule: ExitRule | None = None) -> None:
        """Build the graphs for `caps` (and `chunk`-wide forwards) on a scratch copy of `cache`'s geometry,
        so no later step waits for a compile."""
        scratch = StaticCache(self.model, cache.batch, cache.capacity, cache.max_loops, cache.mode, cache.dtype)
        scratch.window = cache.window
        tokens = torch.zeros(cache.batch, chunk, dtype=torch.long, device=cache.lengths.device)
        for cap in caps:
            scratch.lengths.zero_()
            self(scratch, tokens, torch.full_like(scratch.lengths, cap), cap, exit_rule)
