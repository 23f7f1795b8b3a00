"""Chunked gated DeltaProduct in plain PyTorch: the CPU path, differentiated by autograd.

A token with n_h Householder sub-steps is a gated delta rule over the expanded sequence of length
T*n_h, with the token's decay on its first sub-step and its query on its last. Write
S_i = exp(g_i) S_{i-1} + k_i u_i^T, where u_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i) is the
sub-step's effective value. Inside a chunk that starts from state S_0, with G the within-chunk
cumulative log decay,

    u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(G_i) S_0^T k_i,

a unit lower-triangular system (the WY / UT-transform form). Solving it for every chunk at once
leaves only a cheap state hand-off between chunks sequential. Only decay differences G_i - G_j
with j <= i are ever exponentiated, so nothing overflows however strong the decay.

Resets (documents packed into one row): a token that starts a sequence zeroes the state before it.
Within a chunk, rows are numbered by the resets at or before them (their segment); every decay
factor that would carry something across a reset is exactly zero: exp(G_i - G_j) only within one
segment, exp(G_i) (from the chunk's start state) only in segment 0, exp(G_end - G_j) (to the next
chunk) only in the last segment. The exponents stay the same differences, so resets add no overflow,
and a reset row's own decay reaches nothing (its gradient is zero).
"""

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def _expand(q, g, n_h):
    """Put each token's query on its last sub-step and its decay on its first (zeros elsewhere)."""
    B, T, H, K = q.shape
    q = torch.cat([q.new_zeros(B, T, n_h - 1, H, K), q[:, :, None]], dim=2)
    g = torch.cat([g[:, :, None], g.new_zeros(B, T, n_h - 1, H)], dim=2)
    return q.reshape(B, T * n_h, H, K), g.reshape(B, T * n_h, H)


def _segments(resets, n_h, pad, C):
    """[B, 1, N, C]: per expanded row, how many resets its chunk holds at or before it (a token's reset
    sits on its first sub-step, with its decay)."""
    B, T = resets.shape
    rows = torch.cat([resets[:, :, None], resets.new_zeros(B, T, n_h - 1)], dim=2).reshape(B, T * n_h)
    return F.pad(rows.int(), (0, pad)).reshape(B, 1, -1, C).cumsum(-1)


# The decay factors of a chunk's rows, zero where a reset lies between (seg None: no resets). Each call
# is its own exp, as the op was written before resets, so without them every gradient keeps its bits.


def _from_start(G, seg):
    """exp(G): the chunk's start state's decay at each row."""
    return G.exp() if seg is None else torch.where(seg == 0, G.exp(), 0.0)


def _to_end(G, seg):
    """exp(G_end - G): each row's decay to the chunk's end."""
    to_end = (G[..., -1:] - G).exp()
    return to_end if seg is None else torch.where(seg == seg[..., -1:], to_end, 0.0)


def _chunk_decay(G, seg):
    """exp(G_end): the start state's decay over the whole chunk."""
    return G[..., -1].exp() if seg is None else torch.where(seg[..., -1] == 0, G[..., -1].exp(), 0.0)


def chunk_gated_delta_product(
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
    resets=None,
):
    """Shapes as in `gated_delta_product`; arguments are assumed already validated."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_h, C = num_householder, chunk_size
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q, g = _expand(q * scale, g, n_h)

    # Heads first, expanded length padded to whole chunks, then split into [B, H, N, C, ...].
    # Padded sub-steps have g = 0 and beta = 0: they leave the state exactly as it was.
    L = T * n_h
    pad = -L % C
    N = (L + pad) // C
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, N, C, -1) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)).reshape(B, H, N, C) for x in (g, beta))

    G = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    seg = _segments(resets, n_h, pad, C) if resets is not None else None
    if seg is not None:
        causal = causal & (seg[..., :, None] == seg[..., None, :])
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # Strictly lower part of the system; solve_triangular supplies the unit diagonal.
    A = ((k @ k.transpose(-1, -2)) * decay * beta[..., None]).tril(-1)
    rhs = torch.cat([beta[..., None] * v, (beta * _from_start(G, seg))[..., None] * k], dim=-1)
    u_from_v, u_from_state = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split(
        [V, K], dim=-1
    )

    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * _from_start(G, seg)[..., None]
    k_to_end = k * _to_end(G, seg)[..., None]
    chunk_decay = _chunk_decay(G, seg)[..., None, None]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for n in range(N):
        u = u_from_v[:, :, n] - u_from_state[:, :, n] @ S
        outputs.append(q_decayed[:, :, n] @ S + qk[:, :, n] @ u)
        S = chunk_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ u

    o = torch.stack(outputs, dim=2).reshape(B, H, N * C, V)[:, :, :L]
    o = o.reshape(B, H, T, n_h, V)[:, :, :, -1].transpose(1, 2)
    return o, (S if output_final_state else None)
