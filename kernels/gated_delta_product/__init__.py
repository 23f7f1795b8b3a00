"""Gated DeltaProduct (DESIGN.md §3.2): one public op, several implementations behind `impl`.

"naive" is the token loop kept as the oracle; "chunk" is the chunked PyTorch form used on CPU.
Every implementation computes in fp32 (fp64 stays fp64) and takes the same, flash-linear-attention
style, batch-first arguments, so the model never needs to know which one ran.
"""

from kernels.gated_delta_product.chunk import chunk_gated_delta_product
from kernels.gated_delta_product.naive import naive_gated_delta_product

IMPLEMENTATIONS = {
    "chunk": chunk_gated_delta_product,
    "naive": naive_gated_delta_product,
}


def gated_delta_product(q, k, v, g, beta, *, num_householder, scale=None, initial_state=None,
                        output_final_state=False, impl="chunk"):
    """Run the gated DeltaProduct recurrence over a batch of sequences.

    q: [B, T, H, K]; k: [B, T*n_h, H, K]; v: [B, T*n_h, H, V]; beta: [B, T*n_h, H];
    g: [B, T, H] (log decay, <= 0), with n_h = num_householder. Row t*n_h + j of k, v and beta is
    Householder sub-step j of token t. q and k must already be L2-normalised; scale defaults to
    K**-0.5. initial_state: [B, H, K, V] or None.

    Returns (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] in fp32, or None unless
    output_final_state).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown gated_delta_product impl {impl!r}; "
                         f"expected one of {sorted(IMPLEMENTATIONS)}")
    _check_shapes(q, k, v, g, beta, num_householder, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state = IMPLEMENTATIONS[impl](q, k, v, g, beta, num_householder, scale,
                                           initial_state, output_final_state)
    return o.to(q.dtype), final_state


def _check_shapes(q, k, v, g, beta, num_householder, initial_state):
    if isinstance(num_householder, bool) or not isinstance(num_householder, int) \
            or num_householder < 1:
        raise ValueError(f"num_householder must be a positive int, got {num_householder!r}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError("gated_delta_product needs at least one token (T >= 1)")
    if v.ndim != 4:
        raise ValueError(f"v must be [B, T*n_h, H, V], got shape {tuple(v.shape)}")
    V = v.shape[-1]
    L = T * num_householder
    expected = {
        "k": (k, (B, L, H, K)),
        "v": (v, (B, L, H, V)),
        "g": (g, (B, T, H)),
        "beta": (beta, (B, L, H)),
    }
    if initial_state is not None:
        expected["initial_state"] = (initial_state, (B, H, K, V))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} "
                             f"(B={B}, T={T}, H={H}, K={K}, V={V}, "
                             f"num_householder={num_householder})")
