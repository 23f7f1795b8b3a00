"""Gated DeltaProduct (docs/DESIGN.md §3.2): one public op, several implementations behind `impl`.

"naive" is the token loop kept as the oracle; "chunk" is the chunked PyTorch form used on CPU;
"triton" is the chunked Triton kernel set (GPU, or CPU under TRITON_INTERPRET=1); "auto" picks
triton for CUDA tensors and chunk otherwise. Every implementation accumulates in fp32 (fp64 stays
fp64 where the PyTorch forms are used) and takes the same, flash-linear-attention style,
batch-first arguments, so the model never needs to know which one ran. `resets` marks the tokens
that start a new sequence (documents packed into one row): the state before such a token is zero,
in every implementation, forward and backward. `gated_delta_product_step` is the one-token form
for decoding.
"""

import torch

from elr_kernels.gated_delta_product.chunk import chunk_gated_delta_product
from elr_kernels.gated_delta_product.naive import naive_gated_delta_product

try:
    from elr_kernels.gated_delta_product.triton_decode import triton_gated_delta_product_step
    from elr_kernels.gated_delta_product.triton_op import triton_gated_delta_product
except ImportError as error:  # triton is a dependency, but keep the PyTorch forms usable without it
    _TRITON_IMPORT_ERROR = error
    triton_gated_delta_product = triton_gated_delta_product_step = None

IMPLEMENTATIONS = {
    "chunk": chunk_gated_delta_product,
    "naive": naive_gated_delta_product,
    "triton": triton_gated_delta_product,
}
IMPL_CHOICES = ("auto", *IMPLEMENTATIONS)


def l2_normalize(x):
    """x / sqrt(|x|^2 + 1e-6) over the last dim: the q/k normalisation use_qk_l2norm applies
    (the Triton kernels compute the same inside)."""
    x32 = x.float() if x.dtype != torch.float64 else x
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _resolve(impl, q):
    if impl == "auto":
        impl = "triton" if q.is_cuda else "chunk"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown gated_delta_product impl {impl!r}; expected one of {list(IMPL_CHOICES)}")
    if impl == "triton" and triton_gated_delta_product is None:
        raise ImportError(f"impl='triton' needs triton: {_TRITON_IMPORT_ERROR}")
    return impl


def gated_delta_product(
    q,
    k,
    v,
    g,
    beta,
    *,
    num_householder,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm=False,
    impl="chunk",
    resets=None,
):
    """Run the gated DeltaProduct recurrence over a batch of sequences.

    q: [B, T, H, K]; k: [B, T*n_h, H, K]; v: [B, T*n_h, H, V]; beta: [B, T*n_h, H];
    g: [B, T, H] (log decay, <= 0), with n_h = num_householder. Row t*n_h + j of k, v and beta is
    Householder sub-step j of token t. q and k must be L2-normalised, or use_qk_l2norm=True
    normalises them (`l2_normalize`; in-kernel for triton). scale defaults to K**-0.5.
    initial_state: [B, H, K, V] or None. resets: [B, T] bool or None; True where a token starts a
    new sequence: the state it sees is zero, not the decayed state before it (the initial state
    included, where the first token resets). None: no resets, the same result bit for bit as
    all False.

    Returns (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] in fp32, or None unless
    output_final_state).
    """
    impl = _resolve(impl, q)
    _check_shapes(q, k, v, g, beta, num_householder, initial_state)
    _check_resets(resets, q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if impl == "triton":
        o, final_state = triton_gated_delta_product(
            q,
            k,
            v,
            g,
            beta,
            num_householder,
            scale,
            initial_state,
            output_final_state,
            qk_l2norm=use_qk_l2norm,
            resets=resets,
        )
    else:
        if use_qk_l2norm:
            q, k = l2_normalize(q), l2_normalize(k)
        o, final_state = IMPLEMENTATIONS[impl](
            q, k, v, g, beta, num_householder, scale, initial_state, output_final_state, resets=resets
        )
    return o.to(q.dtype), final_state


def gated_delta_product_step(
    q, k, v, g, beta, state=None, *, num_householder, scale=None, use_qk_l2norm=False, impl="auto"
):
    """One decoding step: the op over a single token (T = 1) from `state`, shapes as in
    `gated_delta_product`. Returns (o [B, 1, H, V], new state [B, H, K, V] in fp32).
    impl, any of IMPL_CHOICES: "triton" (the one-token kernel), "naive" or "chunk" (for one token
    the chunked form is the token loop: both take the naive step), "auto" (triton on CUDA, naive
    otherwise)."""
    if impl == "auto":
        impl = "triton" if q.is_cuda else "naive"
    if impl not in IMPL_CHOICES:
        raise ValueError(f"unknown gated_delta_product_step impl {impl!r}; expected one of {list(IMPL_CHOICES)}")
    if impl == "chunk":
        impl = "naive"
    if q.shape[1] != 1:
        raise ValueError(f"gated_delta_product_step takes one token, got q of shape {tuple(q.shape)}")
    _check_shapes(q, k, v, g, beta, num_householder, state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)
    if impl == "triton":
        _resolve("triton", q)
        return triton_gated_delta_product_step(q, k, v, g, beta, state, num_householder, scale, qk_l2norm=use_qk_l2norm)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    o, new_state = naive_gated_delta_product(q, k, v, g, beta, num_householder, scale, state, True)
    return o.to(q.dtype), new_state.float()


def _check_shapes(q, k, v, g, beta, num_householder, initial_state):
    if isinstance(num_householder, bool) or not isinstance(num_householder, int) or num_householder < 1:
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
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(B={B}, T={T}, H={H}, K={K}, V={V}, "
                f"num_householder={num_householder})"
            )


def _check_resets(resets, q):
    if resets is None:
        return
    if resets.dtype != torch.bool or tuple(resets.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"resets must be a bool tensor [B, T] = {tuple(q.shape[:2])}, got {resets.dtype} {tuple(resets.shape)}"
        )
