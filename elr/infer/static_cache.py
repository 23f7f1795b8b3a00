"""The static decode state: KV caches and GDP states for a fixed number of rows and columns, every shape
fixed and every update in place, so one compiled decode step (elr/infer/decode.py) serves every token.

It implements the models' Cache Protocol (elr/models/cache.py) as elr/infer/cache.py's InferenceCache
does, with the same entries (each layer kind's InferenceState: attention keys and values, GDP states), in
the same modes (`per_loop`, `last_loop_kv`, `last_loop`), but where InferenceCache shares one column index
between its rows, here each row has its own, kept on the device:

- `start[b]`: row b's first real column (its left padding before it; a prompt batch is left-padded),
- `lengths[b]`: the columns it holds; its next chunk is written at lengths[b], lengths[b] + 1, ...,
- `active[b]`: whether it holds a sequence at all (a free row rides along: its states stay as they are,
  its length does not grow).

A row's positions count from its start. Attention reads the first `window` columns (the capacity unless
a caller narrows it) through a mask that hides columns past each row's length, so no shape depends on
how far decoding has gone; callers keep the window near what the longest row needs, in powers of two
(`decode.capacity_for`), a graph per window. Nothing here reads a row's length back to the host.

The loop conditioning's FiLM depends on the loop and the budget alone, so the cache computes it once for
the weights it is built with (`films`, LoopConditioning.table) and every forward through it reads rows of
that table instead of running the heads: a cache serves one set of weights (a generate call, a server).

Rows join and leave by index (a server's continuous batching, elr/serve/slots.py): `load_row` copies a
prefilled row from another StaticCache (any capacity that fits) with its columns where they were;
`release_row` frees one. Self-speculative decoding rewinds a row by its length and GDP states by a
snapshot (`snapshot`, `restore`). The loops a forward runs at most (`loop_cap`) are set by the caller
before each forward (a compiled step is built per cap); rows below it are masked, never branched on.
"""

from __future__ import annotations

import torch

from elr.infer.cache import check_cache_shape, new_entries
from elr.models.budget import LoopBudget
from elr.models.layers import LAYER_KINDS


class StaticCache:
    def __init__(
        self,
        model,
        batch: int,
        capacity: int,
        max_loops: int,
        mode: str = "per_loop",
        dtype: torch.dtype | None = None,
    ):
        dtype, device = check_cache_shape(model, capacity, mode, dtype)
        self.batch, self.capacity, self.max_loops, self.mode, self.dtype = batch, capacity, max_loops, mode, dtype
        self.loop_cap = max_loops  # the most loops the next forward runs (the compiled step's own)
        self.window = capacity  # the columns attention reads: every row's length + chunk must stay within it
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        self.column_ids = torch.arange(capacity, device=device)
        self.rows = self.valid = self.attn_mask = self.columns = None
        self.row_loops = torch.zeros(batch, dtype=torch.long, device=device)
        conditioning = model.recurrent.conditioning
        # The FiLM of every (loop, budget) pair of these weights, read instead of running the heads each step
        # (they depend on nothing else; a cache is built for one set of weights: a generate call, a server).
        self.films = conditioning.table() if conditioning is not None else None
        self.static_marked = False  # whether the compiler was told the buffers keep their addresses (CUDA graphs)
        self.entries = new_entries(model, self, dtype, device)
        # the attention entries (layer, loop, entry): the ones whose columns move with a row
        self.by_column = [
            (layer, loop, entry)
            for (layer, loop), entry in self.entries.items()
            if LAYER_KINDS[layer.kind].inference_state.name == "attention_kv"
        ]

    # --- the Cache Protocol (elr/models/cache.py) ---

    def loop_range(self, loops: LoopBudget) -> tuple[int, int]:
        """A per-row budget runs up to `loop_cap` with every row masked from loop 2 on (no read-back)."""
        if torch.is_tensor(loops):
            return 1, self.loop_cap
        return loops, loops

    def entry(self, layer, loop: int):
        if LAYER_KINDS[layer.kind].inference_state is None:
            return None
        return self.entries[layer, loop if (layer, loop) in self.entries else 1]

    def begin(self, chunk: int, loops: LoopBudget) -> torch.Tensor:
        """Start a forward over `chunk` new columns per row, written at each row's length; returns each
        row's positions [B, chunk]."""
        if not torch.is_tensor(loops) and loops > self.max_loops or self.loop_cap > self.max_loops:
            raise ValueError(f"this cache was built for at most k={self.max_loops}")
        if chunk > self.capacity:
            raise ValueError(f"{chunk} columns exceed the cache capacity {self.capacity}")
        offsets = torch.arange(chunk, device=self.lengths.device)
        self.columns = columns = self.lengths[:, None] + offsets  # [B, T]
        positions = columns - self.start[:, None]
        self.valid = (positions >= 0) & self.active[:, None]
        self.row_loops = torch.zeros_like(self.row_loops)
        keys = self.column_ids[: self.window]
        causal = keys[None, None, :] <= columns[:, :, None]  # [B, T, C]
        real = (keys[None, :] >= self.start[:, None])[:, None, :]  # [B, 1, C]
        # A padding column sees only itself, so no softmax row is empty; real columns never see it.
        self.attn_mask = (causal & (real | (keys[None, None, :] == columns[:, :, None])))[:, None]
        return positions.clamp(min=0)

    def store(self, buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Scatter the chunk's `values` [B, H, T, D] to each row's own columns of `buffer` [B, H, C, D]
        (rows outside `rows` keep theirs); returns the buffer's window (the mask hides what is not yet
        written)."""
        values = values.to(buffer.dtype)
        if self.rows is not None:
            values = torch.where(self.rows[:, None, None, None], values, buffer.gather(2, self._index(buffer)))
        self._write(buffer, values)
        return buffer[:, :, : self.window]

    def set_rows(self, rows: torch.Tensor | None, loop: int | None = None) -> None:
        self.rows = rows
        if loop is not None:
            self.row_loops = torch.where(rows, loop, self.row_loops) if rows is not None else self.row_loops.fill_(loop)

    def advance(self) -> None:
        """Commit the GDP states, fill the per-loop attention entries of loops a row did not run (as
        InferenceCache does, for every row: no branch on the data), and grow each active row's length."""
        for entry in self.entries.values():
            entry.commit()
        if self.mode == "per_loop":
            previous = {}
            for layer, loop, entry in self.by_column:  # a layer's loops in order, so copies chain
                if loop > 1:
                    skipped = (self.row_loops < loop)[:, None, None, None]
                    for dst, src in zip(entry.tensors(), previous[layer].tensors()):
                        index = self._index(dst)
                        self._write(dst, torch.where(skipped, src.gather(2, index), dst.gather(2, index)))
                previous[layer] = entry
        self.lengths.add_(self.active.long() * self.columns.shape[1])

    def _write(self, buffer: torch.Tensor, values: torch.Tensor) -> None:
        """buffer[b, :, column of row b's t-th new token] = values[b, :, t], in place. An index_put, not a
        scatter_: compiled, inductor writes an index_put into the buffer where it is, while a scatter_ into a
        graph input copied the whole buffer every step (the compiled step was 0.3x eager at 64 rows)."""
        columns = self.columns.clamp(max=self.capacity - 1)  # a free row's writes land on its own last column
        rows = torch.arange(buffer.shape[0], device=buffer.device)[:, None]
        buffer[rows, :, columns] = values.transpose(1, 2)

    def _index(self, buffer: torch.Tensor) -> torch.Tensor:
        """The running chunk's columns as a scatter/gather index into `buffer` [B, H, C, D]: [B, H, T, D]
        (clamped to the capacity: a free row's writes land on its own last column)."""
        columns = self.columns.clamp(max=self.capacity - 1)
        return columns[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])

    # --- rows that join and leave, rewinds ---

    def release_row(self, row: int) -> None:
        """Row `row` holds nothing: it rides along, its states unchanged, its length not growing."""
        self.active[row] = False
        self.lengths[row] = 0
        self.start[row] = 0

    def load_row(self, row: int, source: StaticCache, source_row: int) -> None:
        """Copy a prefilled row of `source` (the same model, mode and loop count) into row `row`, its columns
        where they were: it then decodes here as it would have there."""
        same = (source.max_loops, source.mode) == (self.max_loops, self.mode)
        if not same or source.entries.keys() != self.entries.keys():
            raise ValueError("a row moves only between caches of one model, KV mode and loop count")
        n = int(source.lengths[source_row])
        if n > self.capacity:
            raise ValueError(f"a row of {n} columns does not fit a cache of {self.capacity}")
        for key, entry in self.entries.items():
            by_column = LAYER_KINDS[key[0].kind].inference_state.name == "attention_kv"
            for dst, src in zip(entry.tensors(), source.entries[key].tensors()):
                if by_column:  # k, v [B, H, C, D]
                    dst[row, :, :n] = src[source_row, :, :n]
                else:  # a state holds no columns
                    dst[row] = src[source_row]
        self.start[row], self.lengths[row], self.active[row] = source.start[source_row], n, True

    def snapshot(self) -> tuple[torch.Tensor, dict]:
        """What `restore` needs to rewind every row to what it holds now: the lengths (attention forgets
        columns past them) and copies of the GDP states (they fold every column in)."""
        return self.lengths.clone(), {key: entry.snapshot() for key, entry in self.entries.items()}

    def restore(self, saved: tuple[torch.Tensor, dict]) -> None:
        lengths, states = saved
        self.lengths.copy_(lengths)
        for key, entry in self.entries.items():
            entry.restore(states[key])

    def rewind_by_length(self) -> bool:
        """Whether setting a row's length back is a whole rewind (no entry folds columns into a state)."""
        return all(entry.snapshot() is None for entry in self.entries.values())

    def mark_static(self) -> None:
        """Tell the compiler every buffer here keeps its address (CUDA graphs then replay over them,
        updating them in place)."""
        films = []
        if self.films is not None:
            films = [t for film in [*self.films.loops, self.films.exits] if film for group in film for t in group]
        for tensor in [self.start, self.lengths, self.active, self.column_ids, self.row_loops, *self.tensors(), *films]:
            torch._dynamo.mark_static_address(tensor)
        self.static_marked = True

    def tensors(self) -> list[torch.Tensor]:
        return [t for entry in self.entries.values() for t in entry.tensors()]

    def nbytes(self) -> dict[str, int]:
        """Measured bytes of the stored tensors, by the name of each kind's state ("attention_kv", ...)."""
        sizes = dict.fromkeys((kind.inference_state.name for kind in LAYER_KINDS.values() if kind.inference_state), 0)
        for (layer, _), entry in self.entries.items():
            sizes[LAYER_KINDS[layer.kind].inference_state.name] += sum(t.nbytes for t in entry.tensors())
        return sizes
