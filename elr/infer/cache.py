"""Inference state for incremental decoding: attention KV caches and GDP states, per loop or shared.

The model runs its usual forward code; `ELRModel.forward(tokens, loops, cache)` asks this cache for
each row's positions, and every layer that keeps state asks it for its entry at loop i: the object its
kind registers (`LayerKind.inference_state`, elr/models/layers.py: keys and values for attention, the
recurrent and short-conv state for GDP). What the model may ask is the Protocol `Cache` in
elr/models/cache.py, which `InferenceCache` implements. Three modes:

- `per_loop`: every (recurrent layer, loop) pair keeps its own entry, so a decoded token sees
  exactly what the full-sequence forward would show it. The exact reference.
- `last_loop_kv` (the paper, arXiv 2610.12582): one attention KV entry per physical layer whatever
  k is. Each loop overwrites the chunk's rows, so later tokens read earlier tokens' final-loop keys
  and values; attention KV memory stays at its one-loop size. GDP layers keep per-loop state, as the
  paper's ("GDP layers keep per-loop state ... below 25 MiB per request at four loops").
- `last_loop`: the same for attention, and a GDP layer also keeps one state (our reading, by the same
  rule): every loop of a chunk starts from the state the previous chunk's final loop left. Smaller
  by (k - 1) GDP states; what it costs in loss: docs/inference.md.

Mixed budgets (`loops` a LongTensor [B], one k per row): the cache holds entries for the largest
k, and while the recurrent block runs loops past a row's budget it says so (`set_rows`): the entries
then keep that row's columns as they were, so its shared entry holds its own last loop, as it would
alone. A cache may also run forwards at fewer loops than it was built for (drafting, exits).

Within one chunk (a prefill) both modes compute the exact full-sequence forward; they differ only
in what later chunks read. Batches of prompts of different lengths are left-padded: row b's first
`pad[b]` columns are padding, hidden from attention and kept out of GDP states, and its positions
start at 0 on its first real token. States are stored in the cache's dtype (our choice; the paper's
"under 25 MiB" GDP figure needs bf16 states).

A server (elr/serve) keeps elr/infer/static_cache.py's StaticCache instead, whose rows have a column
index each, so requests join and leave by index; it decodes what this cache decodes (tests/test_decode.py).
"""

from __future__ import annotations

import torch

from elr.infer.kv_modes import MODES, keeps_per_loop
from elr.models.budget import LoopBudget, as_loop_budget, budget_range
from elr.models.layers import LAYER_KINDS


class InferenceCache:
    """Everything one batch of requests keeps between forward calls, for one loop count k. It implements
    the model's cache interface (elr/models/cache.py's Cache Protocol; tests/test_infer.py checks it),
    and adds the rewinds of self-speculative decoding and the rows a server moves (below).

    pad: [B] left-padding columns per row (None: no padding); capacity: the most tokens a row will
    hold (prompt columns plus generated tokens); max_loops: k, or the most any forward through it will
    run (per-row budgets, exits, drafts); dtype: KV and state storage (default: the model's).
    """

    def __init__(
        self,
        model,
        batch: int,
        capacity: int,
        max_loops: int,
        mode: str = "per_loop",
        pad: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ):
        dtype, device = check_cache_shape(model, capacity, mode, dtype)
        self.batch, self.capacity, self.max_loops, self.mode = batch, capacity, max_loops, mode
        self.pad = torch.zeros(batch, dtype=torch.long, device=device) if pad is None else pad.to(device)
        self.length = 0  # columns already cached
        self.chunk = 0  # columns in the forward now running
        self.valid = self.attn_mask = None
        self.rows = None  # [B] bool: the rows whose results the running loop stores (None: all)
        self.films = None  # the reference runs the conditioning's heads in every forward
        self.entries = new_entries(model, self, dtype, device)

    def entry(self, layer, loop: int):
        """What `layer` keeps at loop i (its only one where it keeps one for all loops); None for a
        kind that keeps nothing."""
        if LAYER_KINDS[layer.kind].inference_state is None:
            return None
        return self.entries[layer, loop if (layer, loop) in self.entries else 1]

    def loop_range(self, loops: LoopBudget) -> tuple[int, int]:
        """(the fewest, the most) loops of `loops`: a per-row budget is read back in one transfer."""
        return budget_range(loops)

    def begin(self, chunk: int, loops: LoopBudget) -> torch.Tensor:
        """Start a forward over `chunk` new columns at `loops` (k or per-row budgets [B]); returns each
        row's positions [B, chunk]."""
        most = budget_range(as_loop_budget(loops, self.batch))[1]
        if most > self.max_loops:
            raise ValueError(f"this cache was built for at most k={self.max_loops}, not k={most}")
        if self.length + chunk > self.capacity:
            raise ValueError(f"{self.length + chunk} columns exceed the cache capacity {self.capacity}")
        device = self.pad.device
        columns = torch.arange(self.length, self.length + chunk, device=device)
        positions = columns[None, :] - self.pad[:, None]
        self.chunk, self.valid = chunk, positions >= 0
        self.row_loops = torch.zeros(self.batch, dtype=torch.long, device=device)  # loops each row runs (set_rows)
        keys = torch.arange(self.length + chunk, device=device)
        causal = keys[None, :] <= columns[:, None]  # [T, S]
        real = keys[None, :] >= self.pad[:, None]  # [B, S]
        # A padding column sees only itself, so no softmax row is empty; real columns never see it.
        self.attn_mask = (causal[None] & (real[:, None] | (keys[None, :] == columns[:, None])[None]))[:, None]
        return positions.clamp(min=0)

    def store(self, buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write the chunk's `values` [B, H, chunk, D] at columns length.. of `buffer` (rows outside `rows`
        keep theirs: mixed budgets keep a finished row's own last loop); returns every column so far."""
        start, end = self.length, self.length + values.shape[2]
        values = values.to(buffer.dtype)
        if self.rows is not None:
            values = torch.where(self.rows[:, None, None, None], values, buffer[:, :, start:end])
        buffer[:, :, start:end] = values
        return buffer[:, :, :end]

    def set_rows(self, rows: torch.Tensor | None, loop: int | None = None) -> None:
        """The recurrent block's running `loop` counts only for `rows` ([B] bool; None: every row): the
        entries keep the other rows' columns and states as they are."""
        self.rows = rows
        if loop is not None:
            self.row_loops = torch.where(rows, loop, self.row_loops) if rows is not None else self.row_loops.fill_(loop)

    def _fill_skipped_loops(self) -> None:
        """Per-loop attention entries at the loops a row did not run (past its budget or its exit) take
        its columns from the loop before, so they hold its own last loop's keys and values, what later
        tokens running those loops then read (GDP states at those loops are left as they were: the
        token is skipped there)."""
        short = self.row_loops < self.max_loops
        if not bool(short.any()):
            return
        columns = slice(self.length, self.length + self.chunk)
        for (layer, loop), entry in self.entries.items():  # a layer's loops in order, so copies chain
            if loop == 1 or LAYER_KINDS[layer.kind].inference_state.name != "attention_kv":
                continue
            skipped = (self.row_loops < loop)[:, None, None, None]
            for dst, src in zip(entry.tensors(), self.entries[layer, loop - 1].tensors()):  # k, v [B, H, S, D]
                dst[:, :, columns] = torch.where(skipped, src[:, :, columns], dst[:, :, columns])

    def advance(self) -> None:
        """The forward is done: commit what the entries held back (GDP states) and count its columns
        as cached."""
        for entry in self.entries.values():
            entry.commit()
        self._fill_skipped_loops()
        self.length += self.chunk
        self.chunk = 0

    def snapshot(self) -> tuple[int, dict]:
        """What `restore` needs to rewind to the columns cached now (self-speculative decoding: drafts
        and rejected tokens are taken back). Attention needs only the length; GDP states are copied."""
        return self.length, {key: entry.snapshot() for key, entry in self.entries.items()}

    def restore(self, saved: tuple[int, dict]) -> None:
        self.length, states = saved
        for key, entry in self.entries.items():
            entry.restore(states[key])

    def rewind_by_length(self) -> bool:
        """Whether setting `length` back is a whole rewind (no entry folds columns into a state)."""
        return all(entry.snapshot() is None for entry in self.entries.values())

    def nbytes(self) -> dict[str, int]:
        """Measured bytes of the stored tensors, by the name of each kind's state ("attention_kv", ...)."""
        sizes = dict.fromkeys((kind.inference_state.name for kind in LAYER_KINDS.values() if kind.inference_state), 0)
        for (layer, _), entry in self.entries.items():
            sizes[LAYER_KINDS[layer.kind].inference_state.name] += sum(t.nbytes for t in entry.tensors())
        return sizes


def check_cache_shape(model, capacity: int, mode: str, dtype: torch.dtype | None):
    """Refuse a mode or a capacity the model cannot serve; returns the (dtype, device) of the cache's storage."""
    if mode not in MODES:
        raise ValueError(f"unknown KV cache mode {mode!r}; use one of {', '.join(MODES)}")
    if capacity > model.args.max_seq_len:
        raise ValueError(f"{capacity} positions exceed the model's RoPE table (max_seq_len={model.args.max_seq_len})")
    weight = model.output.weight
    return dtype or weight.dtype, weight.device


def new_entries(model, cache, dtype: torch.dtype, device) -> dict:
    """(layer, loop) -> the entry its kind keeps: one per loop for a recurrent layer where `cache.mode` keeps
    its kind per loop (up to `cache.max_loops`), else one (loop 1). Built after the cache's shape is set."""
    recurrent = set(model.recurrent.layers)
    entries: dict[tuple[torch.nn.Module, int], object] = {}
    for layer in model.layers():
        state = LAYER_KINDS[layer.kind].inference_state
        if state is None:
            continue
        copies = cache.max_loops if layer in recurrent and keeps_per_loop(cache.mode, state.name) else 1
        for loop in range(1, copies + 1):
            entries[layer, loop] = state.new(layer.sublayer, cache, dtype, device)
    return entries
