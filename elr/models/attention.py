"""Grouped-query causal attention with partial RoPE (rotary on the first half of each head's dims)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elr.models.args import ModelArgs


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
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
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

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None) -> torch.Tensor:
        """`cache` (inference only, elr/infer/cache.py) stores this chunk's keys and values and
        hands back every cached one with the mask that hides padding and the future."""
        B, T, _ = x.shape  # heads counted from the projections: under TP each rank has its own share
        q = apply_partial_rope(self.wq(x).view(B, T, -1, self.head_dim), rope).transpose(1, 2)
        k = apply_partial_rope(self.wk(x).view(B, T, -1, self.head_dim), rope).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        mask = None
        if cache is not None:
            k, v, mask = cache.update(k, v)
        elif self.context_parallel is not None:  # this shard's and every earlier shard's keys, mask offset
            k, v, mask = self.context_parallel.gather_kv(k, v)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1],
        )
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))
