"""One-token gated DeltaProduct step in Triton, for decoding: state in, (output, new state) out.

A decoding step is n_h rank-1 updates of a [K, V] state per (batch, head): too little work for the
chunked kernels, so one program per (batch, head, value block) keeps its block of the state in
registers, decays it, applies the n_h Householder sub-steps and reads the output out.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    new_state,
    o,
    scale,
    H,
    n_h,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    NORM: tl.constexpr,
):
    v_block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows_k = tl.arange(0, K)
    cols_v = v_block * BV + tl.arange(0, BV)
    state_ptrs = bh * K * V + rows_k[:, None] * V + cols_v[None, :]
    S = tl.load(state + state_ptrs).to(tl.float32)
    S = S * tl.exp(tl.load(g + b * H + h).to(tl.float32))
    for j in range(n_h):
        sub = (b * n_h + j) * H + h  # row of sub-step j in the [B, n_h, H, .] inputs
        k_j = tl.load(k + sub * K + rows_k).to(tl.float32)
        if NORM:
            k_j = k_j * tl.rsqrt(tl.sum(k_j * k_j, 0) + 1e-6)
        v_j = tl.load(v + sub * V + cols_v).to(tl.float32)
        beta_j = tl.load(beta + sub).to(tl.float32)
        error = v_j - tl.sum(S * k_j[:, None], 0)
        S = S + beta_j * k_j[:, None] * error[None, :]
    q_t = tl.load(q + (b * H + h) * K + rows_k).to(tl.float32)
    if NORM:
        q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t, 0) + 1e-6)
    o_t = scale * tl.sum(S * q_t[:, None], 0)
    tl.store(o + (b * H + h) * V + cols_v, o_t.to(o.dtype.element_ty))
    tl.store(new_state + state_ptrs, S)


def triton_gated_delta_product_step(q, k, v, g, beta, state, num_householder, scale, qk_l2norm=False):
    """q [B, 1, H, K], k [B, n_h, H, K], v [B, n_h, H, V], g [B, 1, H], beta [B, n_h, H],
    state [B, H, K, V]. Returns (o [B, 1, H, V] in q's dtype, new state [B, H, K, V] in fp32)."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    for name, d in (("head dim K", K), ("head dim V", V)):
        if d & (d - 1):
            raise ValueError(f"triton gated_delta_product_step needs {name} a power of two, got {d}")
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    o = torch.empty(B, 1, H, V, device=q.device, dtype=q.dtype)
    new_state = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    BV = min(V, 32)
    _decode_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, state, new_state, o, scale, H, num_householder, K=K, V=V, BV=BV, NORM=qk_l2norm
    )
    return o, new_state
