"""Grouped-query causal attention with partial RoPE (rotary on the first half of each head's dims).

Layer kind A: the module, its FLOPs, its tensor-parallel split and its inference cache entry (keys
and values), registered in elr/models/layers.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elr.models.args import ModelArgs
from elr.models.cache import Cache
from elr.models.kinds import Rows, TensorSplit


def rope_table(rope_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin for every position, stacked: [2, max_seq_len, rope_dim // 2]."""
    freqs = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()])


def apply_partial_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate the leading rope_dim dims of each head (half-split pairs); pass the rest through.

    x: [B, T, H, D]; rope: [2, T, rope_dim // 2], or [2, B, T, rope_dim // 2] when each row has its
    own positions (left-padded inference batches).
    """
    half = rope.shape[-1]
    cos, sin = (t[..., None, :].to(x.dtype) for t in rope)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Attention(nn.Module):
    # Context parallelism's hook (elr/parallel/context_parallel.py, which sets it): x is then this rank's
    # slice of each sequence. None: the whole sequence is here.
    context_parallel = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def init_weights(self, out_std: float):
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=out_std)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, cache=None, document_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`cache` (inference only: this layer's AttentionKV entry, below) stores this chunk's keys and values and
        hands back every cached one with the mask that hides padding and the future. `document_mask` (documents
        packed into one row, elr/models/documents.py): the block-causal mask over the same keys, which replaces
        the causal one, so no query sees another document."""
        B, T, _ = x.shape  # heads counted from the projections: under TP each rank has its own share
        q = apply_partial_rope(self.wq(x).view(B, T, -1, self.head_dim), rope).transpose(1, 2)
        k = apply_partial_rope(self.wk(x).view(B, T, -1, self.head_dim), rope).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        mask = None
        if cache is not None:
            k, v, mask = cache.update(k, v)
        elif self.context_parallel is not None:  # this shard's and every earlier shard's keys, mask offset
            k, v, mask = self.context_parallel.gather_kv(k, v)
        if document_mask is not None:
            mask = document_mask
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


def attention_flops(a: ModelArgs, seq_len: int) -> int:
    """The projections, and 12 * heads * head_dim * seq_len for the scores (non-causal, the
    PaLM/torchtitan convention)."""
    weights = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads)
    return 6 * weights + 12 * a.n_heads * a.head_dim * seq_len


def attention_split(a: ModelArgs, tp: int) -> TensorSplit:
    """q/k/v split by heads, o by its input rows; GQA kv heads split when the TP degree divides them,
    otherwise replicated, each rank keeping the one kv head its q heads read."""
    heads, kv_heads = {"attention heads": a.n_heads}, {"attention kv heads": a.n_kv_heads}
    if a.n_kv_heads >= tp:
        return TensorSplit(
            "heads", {"wq.weight": 0, "wk.weight": 0, "wv.weight": 0, "wo.weight": 1}, divides={**heads, **kv_heads}
        )
    kv = Rows(a.n_kv_heads)
    return TensorSplit(
        "heads", {"wq.weight": 0, "wk.weight": kv, "wv.weight": kv, "wo.weight": 1}, divides=heads, multiple_of=kv_heads
    )


class AttentionKV:
    """One attention layer's inference cache entry (at one loop of a Cache, elr/models/cache.py): preallocated keys
    and values [B, n_kv_heads, capacity, head_dim], following the columns and mask of `cache`."""

    def __init__(self, attention: Attention, cache: Cache, dtype, device):
        self.cache = cache
        shape = (cache.batch, attention.n_kv_heads, cache.capacity, attention.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this chunk's k, v [B, H_kv, T, D] (overwriting an earlier loop's) where the cache keeps
        its columns; return the columns to attend to and their mask."""
        keys, values = self.cache.store(self.k, k), self.cache.store(self.v, v)
        return keys.to(k.dtype), values.to(v.dtype), self.cache.attn_mask

    def commit(self) -> None:
        """Nothing is held back: `update` wrote the chunk's rows."""

    def snapshot(self) -> None:
        """Nothing to save for a rewind: columns past the cache's length are never read."""

    def restore(self, saved: None) -> None:
        """Rewinding the cache's length is the whole rewind."""

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


def attention_kv_bytes(a: ModelArgs, context_len: int, element_size: int) -> int:
    """Keys and values of one entry for one request: 2 x n_kv_heads x head_dim x context."""
    return 2 * a.n_kv_heads * a.head_dim * context_len * element_size
