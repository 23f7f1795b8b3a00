"""The Triton gated DeltaProduct as PyTorch ops: `elr::gated_delta_product` and its backward.

Registered with torch.library.custom_op, with fake (meta) implementations and an autograd
formula, so torch.compile traces a GDP layer without a graph break, and selective activation
checkpointing can name `torch.ops.elr.gated_delta_product.default` among the ops whose outputs it
saves. The forward keeps only its inputs for the backward, which recomputes the chunk states.
"""

import torch
from torch import Tensor

from elr_kernels.gated_delta_product.triton_chunk import chunk_backward, chunk_forward

CHUNK_SIZE = 64


@torch.library.custom_op("elr::gated_delta_product", mutates_args=())
def gated_delta_product_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    num_householder: int,
    scale: float,
    chunk_size: int,
    qk_l2norm: bool,
    resets: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(o in q's dtype, final state in fp32); shapes as in `gated_delta_product`."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return chunk_forward(q, k, v, g, beta, initial_state, num_householder, scale, chunk_size, qk_l2norm, resets)


@gated_delta_product_op.register_fake
def _(q, k, v, g, beta, initial_state, num_householder, scale, chunk_size, qk_l2norm, resets=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return q.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=torch.float32)


@torch.library.custom_op("elr::gated_delta_product_backward", mutates_args=())
def gated_delta_product_backward_op(
    do: Tensor,
    d_final: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    num_householder: int,
    scale: float,
    chunk_size: int,
    qk_l2norm: bool,
    resets: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta, d_initial_state in fp32) from the gradients of o and the final
    state; d_final None means the final state was not used."""
    do, q, k, v, g, beta = (x.contiguous() for x in (do, q, k, v, g, beta))
    if d_final is not None:
        d_final = d_final.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return chunk_backward(
        do, d_final, q, k, v, g, beta, initial_state, num_householder, scale, chunk_size, qk_l2norm, resets
    )


@gated_delta_product_backward_op.register_fake
def _(do, d_final, q, k, v, g, beta, initial_state, num_householder, scale, chunk_size, qk_l2norm, resets=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    # contiguous, as the real op returns them whatever the inputs' strides
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        g.new_empty(g.shape),
        beta.new_empty(beta.shape),
        q.new_empty(B, H, K, V, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, num_householder, scale, chunk_size, qk_l2norm, resets = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, resets)
    ctx.options = (num_householder, scale, chunk_size, qk_l2norm)


def _backward(ctx, do, d_final):
    q, k, v, g, beta, initial_state, resets = ctx.saved_tensors
    if do is None:  # only the final state was used
        do = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)
    dq, dk, dv, dg, dbeta, d_initial = gated_delta_product_backward_op(
        do, d_final, q, k, v, g, beta, initial_state, *ctx.options, resets
    )
    if initial_state is not None:
        d_initial = d_initial.to(initial_state.dtype)
    else:
        d_initial = None
    return dq, dk, dv, dg, dbeta, d_initial, None, None, None, None, None


gated_delta_product_op.register_autograd(_backward, setup_context=_setup_context)


def triton_gated_delta_product(
    q,
    k,
    v,
    g,
    beta,
    num_householder,
    scale,
    initial_state=None,
    output_final_state=False,
    chunk_size=CHUNK_SIZE,
    qk_l2norm=False,
    resets=None,
):
    """Same arguments and results as chunk_gated_delta_product; chunk_size a power of two >= 16
    (tests lower it to keep the interpreter fast)."""
    o, final = torch.ops.elr.gated_delta_product(
        q, k, v, g, beta, initial_state, num_householder, float(scale), chunk_size, qk_l2norm, resets
    )
    return o, (final if output_final_state else None)
