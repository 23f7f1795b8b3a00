"""Inference state for incremental decoding: attention KV caches and GDP states, per loop or shared.

The model runs its usual forward code; `ELRModel.forward(tokens, loops, cache)` asks this cache for
each row's positions, and every attention or GDP layer asks it for its slot at loop i. Two modes:

- `per_loop`: every (recurrent layer, loop) pair keeps its own KV cache or GDP state, so a decoded
  token sees exactly what the full-sequence forward would show it. The exact reference.
- `last_loop` (paper, arXiv 2610.12582): one slot per physical layer whatever k is. Each loop
  overwrites the chunk's rows, so later tokens read earlier tokens' final-loop keys and values;
  attention KV memory stays at its one-loop size. Our choice, by the same rule: a GDP layer also
  keeps one state, every loop of a chunk starts from the state the previous chunk's final loop left.

Within one chunk (a prefill) both modes compute the exact full-sequence forward; they differ only
in what later chunks read. Batches of prompts of different lengths are left-padded: row b's first
`pad[b]` columns are padding, hidden from attention and kept out of GDP states, and its positions
start at 0 on its first real token. States are stored in the cache's dtype (our choice; the paper's
"under 25 MiB" GDP figure needs bf16 states).
"""

from __future__ import annotations

import torch

MODES = ("per_loop", "last_loop")


class AttentionSlot:
    """Preallocated keys and values [B, n_kv_heads, capacity, head_dim] of one layer (and loop)."""

    def __init__(self, cache: InferenceCache, n_kv_heads: int, head_dim: int, dtype, device):
        self.cache = cache
        shape = (cache.batch, n_kv_heads, cache.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this chunk's k, v [B, H_kv, T, D] (overwriting an earlier loop's), return all so far."""
        start, end = self.cache.length, self.cache.length + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end].to(k.dtype), self.v[:, :, :end].to(v.dtype), self.cache.attn_mask

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class GDPSlot:
    """One GDP layer's (and loop's) recurrent state [B, H, K, V] and short-conv input tails."""

    def __init__(self, cache: InferenceCache, mixer, dtype, device):
        self.cache = cache
        B, H, D = cache.batch, mixer.n_heads, mixer.head_dim
        self.state = torch.zeros(B, H, D, D, dtype=dtype, device=device)
        self.conv_states = tuple(
            torch.zeros(B, conv.weight.shape[-1] - 1, conv.weight.shape[0], dtype=dtype, device=device)
            for conv in (mixer.q_conv, mixer.k_conv, mixer.v_conv)
        )
        self.pending = None

    @property
    def valid(self) -> torch.Tensor:
        return self.cache.valid

    def write(self, state: torch.Tensor, conv_states: tuple[torch.Tensor, ...]) -> None:
        """Hold the chunk's final state; it replaces the stored one when the whole forward ends, so
        in last_loop mode every loop of the chunk starts from the previous chunk's final loop."""
        self.pending = (state, conv_states)

    def commit(self) -> None:
        if self.pending is not None:
            state, conv_states = self.pending
            self.state.copy_(state)
            for dst, src in zip(self.conv_states, conv_states):
                dst.copy_(src)
            self.pending = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.state, *self.conv_states]


class InferenceCache:
    """Everything one batch of requests keeps between forward calls, for one loop count k.

    pad: [B] left-padding columns per row (None: no padding); capacity: the most tokens a row will
    hold (prompt columns plus generated tokens); dtype: KV and state storage (default: the model's).
    """

    def __init__(self, model, batch: int, capacity: int, loops: int, mode: str = "per_loop",
                 pad: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown KV cache mode {mode!r}; use one of {', '.join(MODES)}")
        if capacity > model.args.max_seq_len:
            raise ValueError(f"{capacity} positions exceed the model's RoPE table (max_seq_len={model.args.max_seq_len})")
        weight = model.output.weight
        dtype, device = dtype or weight.dtype, weight.device
        self.batch, self.capacity, self.loops, self.mode = batch, capacity, loops, mode
        self.pad = torch.zeros(batch, dtype=torch.long, device=device) if pad is None else pad.to(device)
        self.length = 0  # columns already cached
        self.chunk = 0  # columns in the forward now running
        self.valid = self.attn_mask = None
        recurrent = set(model.recurrent.layers)
        self.slots: dict[tuple[torch.nn.Module, int], AttentionSlot | GDPSlot] = {}
        for layer in model.layers():
            copies = loops if mode == "per_loop" and layer in recurrent else 1
            for loop in range(1, copies + 1):
                if layer.kind == "A":
                    a = layer.sublayer
                    self.slots[layer, loop] = AttentionSlot(self, a.n_kv_heads, a.head_dim, dtype, device)
                elif layer.kind == "G":
                    self.slots[layer, loop] = GDPSlot(self, layer.sublayer, dtype, device)

    def slot(self, layer, loop: int):
        if layer.kind not in "AG":
            return None
        return self.slots[layer, loop if self.mode == "per_loop" and (layer, loop) in self.slots else 1]

    def begin(self, chunk: int, loops: int) -> torch.Tensor:
        """Start a forward over `chunk` new columns; returns each row's positions [B, chunk]."""
        if loops != self.loops:
            raise ValueError(f"this cache was built for k={self.loops}, not k={loops}")
        if self.length + chunk > self.capacity:
            raise ValueError(f"{self.length + chunk} columns exceed the cache capacity {self.capacity}")
        device = self.pad.device
        columns = torch.arange(self.length, self.length + chunk, device=device)
        positions = columns[None, :] - self.pad[:, None]
        self.chunk, self.valid = chunk, positions >= 0
        keys = torch.arange(self.length + chunk, device=device)
        causal = keys[None, :] <= columns[:, None]  # [T, S]
        real = keys[None, :] >= self.pad[:, None]  # [B, S]
        # A padding column sees only itself, so no softmax row is empty; real columns never see it.
        self.attn_mask = (causal[None] & (real[:, None] | (keys[None, :] == columns[:, None])[None]))[:, None]
        return positions.clamp(min=0)

    def advance(self) -> None:
        """The forward is done: commit GDP states and count its columns as cached."""
        for slot in self.slots.values():
            if isinstance(slot, GDPSlot):
                slot.commit()
        self.length += self.chunk
        self.chunk = 0

    def nbytes(self) -> dict[str, int]:
        """Measured bytes of the stored tensors, by kind."""
        sizes = {"attention_kv": 0, "gdp_state": 0}
        for slot in self.slots.values():
            kind = "attention_kv" if isinstance(slot, AttentionSlot) else "gdp_state"
            sizes[kind] += sum(t.nbytes for t in slot.tensors())
        return sizes
