"""Routed experts as grouped GEMMs: token permutation and the expert matmuls, with no host sync.

Tokens are sorted by expert once; each expert's rows then form one contiguous group, and one
`torch._grouped_mm` per projection runs every expert at once. Group boundaries stay on the device
(cumulative counts), so a GPU step never waits for the host to learn how many tokens each expert got.
`looped_experts` is the readable reference the tests hold the grouped path to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("elr::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm as an opaque op: a [M, K] x b [E, K, N] -> [M, N] (rows grouped by offsets),
    or a [K, M] x b [M, N] -> [E, K, N] (the weight gradient, groups along M).

    Wrapped so torch.compile treats it as one extern call in any dtype (its own meta function
    accepts bf16 only) and so the backward gets contiguous gradients (a zero-stride one fails).
    """
    return torch._grouped_mm(a, b, offs=offsets)


@grouped_mm.register_fake
def _(a, b, offsets):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])


def _setup_context(ctx, inputs, output):
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)


def _backward(ctx, grad):
    a, b, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = grouped_mm(grad, b.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm(a.t(), grad, offsets) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.elr.grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, offsets_shape, *args, **kwargs) -> int:
    """Each row of a meets one group's matrix: 2 M K N either way round (counted by FlopCounterMode)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def permute_tokens(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, expert) pairs of top-k routing by expert.

    indices: [N, top_k] -> order (pair positions sorted by expert), token_of (the token of each sorted
    pair) and offsets (int32 end row of each expert's group), all computed on the device.
    """
    flat = indices.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on CUDA to size its output
    return order, order // indices.shape[1], counts.cumsum(0).to(torch.int32)


def grouped_experts(xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Squared-ReLU experts on expert-sorted rows xs [M, dim]; w1 [E, hidden, dim], w2 [E, dim, hidden]."""
    h = relu2(grouped_mm(xs, w1.transpose(-2, -1), offsets))
    return grouped_mm(h, w2.transpose(-2, -1), offsets)


def looped_experts(xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The reference: one matmul pair per expert in a Python loop (syncs on the counts)."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long()).tolist()
    outputs = [relu2(rows @ w1[e].t()) @ w2[e].t() for e, rows in enumerate(xs.split(counts)) if counts[e]]
    return torch.cat(outputs) if outputs else xs.new_zeros(0, w2.shape[1])
