"""One update's gradients across ranks: what FSDP's own reduction leaves to do, then the norm and clipping.

FSDP2 reduces the dense gradients in backward, and every parameter comes out of it with a gradient, zeros
where this rank's update never used it (the recurrent block's gradient anchor, elr/parallel/gradient_anchor.py,
sees to that for parameters a loop count leaves idle: the state norm at k = 1, say). One process gives such a
parameter zeros too (`fill_unused`), so its optimizer state, and every later step, is what it is under FSDP,
and a checkpoint holds optimizer state for every parameter. Left to do once per update: the expert stacks that
expert parallelism keeps out of FSDP (`reduce_expert_gradients`), and without FSDP the partial sums
of TP-replicated parameters (`reduce_partial_grads`). The global norm then spans gradients on
different meshes (FSDP's dp or dp x tp mesh, the ep mesh).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elr.parallel.expert_parallel import reduce_expert_gradients
from elr.parallel.parallel_dims import ParallelDims
from elr.parallel.tensor_parallel import reduce_partial_grads


def fill_unused(model: nn.Module) -> None:
    """Zeros as the gradient of each trainable parameter this update did not use (AdamW then keeps stepping
    its moments, as it does for every parameter under FSDP, instead of skipping it)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def reduce_gradients(model: nn.Module, dims: ParallelDims) -> None:
    """Finish the update's gradient reduction (after the last microbatch's backward)."""
    fill_unused(model)
    if dims.ep_mesh is not None:
        reduce_expert_gradients(model, dims.ep_mesh, dims.dp_world * dims.cp)
    if dims.tp_mesh is not None and dims.fsdp_mesh is None:
        reduce_partial_grads(model)  # FSDP's reduction does this when it is on


def grad_norm_by_mesh(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of gradients that live on different meshes (FSDP's dp or dp x tp mesh, the ep mesh):
    torch's total norm stacks them in one op, which DTensor refuses across meshes."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Scale the gradients to a global norm of at most `max_norm` (0: no clipping); returns the norm
    before clipping (NaN/Inf left as they are, for the caller to skip the update)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = grad_norm_by_mesh(grads).item()
    if max_norm > 0 and math.isfinite(total) and total > max_norm:
        torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total
