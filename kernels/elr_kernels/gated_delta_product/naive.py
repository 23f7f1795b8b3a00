"""Token-by-token gated DeltaProduct: the oracle every faster implementation is tested against.

It follows the recurrence of docs/DESIGN.md §3.2 line by line, so it is slow (one Python step per
Householder sub-step) but easy to check by eye. A token whose `resets` flag is set starts a new
sequence: the state before it is zero instead of decayed (documents packed into one row).
"""

import torch


def naive_gated_delta_product(
    q, k, v, g, beta, num_householder, scale, initial_state=None, output_final_state=False, resets=None
):
    """Shapes as in `gated_delta_product`; arguments are assumed already validated."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_h = num_householder
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, g = q.to(dtype), g.to(dtype)
    k = k.to(dtype).reshape(B, T, n_h, H, K)
    v = v.to(dtype).reshape(B, T, n_h, H, V)
    beta = beta.to(dtype).reshape(B, T, n_h, H)
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dtype)

    outputs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        if resets is not None:
            S = torch.where(resets[:, t, None, None, None], 0.0, S)
        for j in range(n_h):
            k_j = k[:, t, j]
            error = v[:, t, j] - torch.einsum("bhkv,bhk->bhv", S, k_j)
            S = S + (beta[:, t, j, :, None] * k_j)[..., :, None] @ error[..., None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outputs, dim=1)
    return o, (S if output_final_state else None)
