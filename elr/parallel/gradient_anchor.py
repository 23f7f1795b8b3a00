"""Every parameter of the recurrent block gets a gradient on every rank, whatever k the rank ran.

FSDP2 reduce-scatters, per unit, the gradients its parameters have. A parameter that a loop count
leaves unused (the state norm at k = 1, FiLM heads of loops a budget never reaches) has no gradient
on a rank that ran that k, so the ranks reduce-scatter different sets of tensors: gloo fails with
"Received data size doesn't match expected size", NCCL hangs or corrupts (docs/LOG.md, 2026-12-04).

The fix for the whole class: the block's output gains `sum(0 * p[0])` over every parameter it owns,
so autograd gives each one a gradient tensor (zeros where this forward did not use it) and every
rank reduces the same tensors in the same order. The value added is exactly zero, and gradients are
unchanged where a parameter was used. Only the recurrent block needs it: it is the one FSDP unit
whose computation depends on k (the input and output blocks, embeddings and head run once per
microbatch whatever k is). The cost is one zero gradient tensor per block parameter per microbatch
in backward, allocated and added (docs/distributed.md gives the figure at 8 x 96 microbatches).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def anchor_parameters(block: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Install the anchor on `block` (a forward hook; training forwards with gradients only). Install
    it before `fully_shard(block)`: FSDP appends its own post-forward hook, which reshards the
    parameters, and the anchor must read them unsharded, so it has to run first."""

    def hook(module: nn.Module, args, output):
        if not (module.training and torch.is_grad_enabled()):
            return output
        zero = None
        for p in module.parameters():
            if p.requires_grad:
                local = p.to_local() if isinstance(p, DTensor) else p
                term = local.reshape(-1)[:1].sum() * 0
                zero = term if zero is None else zero + term
        if zero is None:
            return output
        state, *rest = output if isinstance(output, tuple) else (output,)
        if isinstance(state, list):  # every loop's state (every_loop, loop_exits): each exit is scored, anchor the last
            state = [*state[:-1], state[-1] + zero.to(state[-1].dtype)]
        else:
            state = state + zero.to(state.dtype)
        return (state, *rest) if isinstance(output, tuple) else state

    return block.register_forward_hook(hook)
