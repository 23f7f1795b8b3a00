"""Chunked gated DeltaProduct in Triton: forward and backward kernels and their launchers.

The math is chunk.py's, on the expanded sequence of length L = T*n_h (sub-step j of token t is
row p = t*n_h + j; the token's decay sits on its first sub-step, its query on its last). The
kernels read the caller's batch-first tensors directly and do the expansion with load masks, so
nothing of size L*K is materialised for q, g or the output gradient. Per chunk of C rows, with G
the within-chunk cumulative log decay, D_ij = exp(G_i - G_j) (j <= i), S the state at the chunk's
start and Tinv = (I + strict_lower(beta_i k_i.k_j D_ij))^-1:

    U = Tinv (beta v),  W = Tinv (beta exp(G) k),  u = U - W S          (effective values)
    o = (q exp(G)) S + ((q k^T) * D) u                                  (outputs)
    S_next = exp(G_C) S + (k exp(G_C - G))^T u                          (state hand-off)

Forward: `_prepare_kernel` (every chunk in parallel: G, Tinv, W, U), `_state_kernel` (sequential
over chunks: chunk-start states h and u), `_output_kernel` (every chunk in parallel: o).
Backward recomputes those (nothing of size L*K is kept between forward and backward), then
`_state_grad_kernel` runs the chunks in reverse for the state gradients and du, and
`_chunk_grad_kernel` turns them into dq, dk, dv, dbeta, dg chunk by chunk. Every product
accumulates in fp32; inputs may be fp32, bf16 or fp16. Derivation of the backward: docs/LOG.md.

Resets (HAS_RESETS; a token that starts a new sequence sees a zero state): each kernel numbers its
chunk's rows by the resets at or before them (`_segments`) and zeroes every decay factor that
crosses one (`_decay_matrix`, `_from_start`, `_to_end`, `_chunk_decay`), as chunk.py does; without
resets each is the plain exp it replaces, where it was. The backward needs nothing else:
it is written in those factors, whose derivatives in G are themselves (zero stays zero).
"""

import torch
import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------
# Shared pieces


@triton.jit
def _rows(chunk, T, n_h, C: tl.constexpr):
    """Expanded positions of a chunk's rows, their tokens, and which rows carry g, q and o."""
    pos = chunk * C + tl.arange(0, C)
    token = pos // n_h
    sub = pos % n_h
    valid = pos < T * n_h
    return pos, token, valid, valid & (sub == 0), valid & (sub == n_h - 1)


@triton.jit
def _load_rows(ptr, row, mask, H, h, D: tl.constexpr, NORMALIZE: tl.constexpr):
    """Rows `row` of a [B, rows, H, D] tensor at head h as fp32 [C, D]; masked rows are zero.
    NORMALIZE: each row divided by its L2 norm (see _inverse_norm)."""
    cols = tl.arange(0, D)
    x = tl.load(ptr + (row[:, None] * H + h) * D + cols[None, :], mask=mask[:, None], other=0.0)
    x = x.to(tl.float32)
    if NORMALIZE:
        x = x * _inverse_norm(x)[:, None]
    return x


@triton.jit
def _inverse_norm(x):
    """1 / sqrt(|x|^2 + 1e-6) per row, the in-kernel q/k normalisation (l2_normalize in PyTorch)."""
    return tl.rsqrt(tl.sum(x * x, 1) + 1e-6)


@triton.jit
def _store_rows(ptr, x, row, mask, H, h, D: tl.constexpr):
    cols = tl.arange(0, D)
    tl.store(ptr + (row[:, None] * H + h) * D + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _segments(resets, b, T, token, first, C: tl.constexpr, HAS_RESETS: tl.constexpr):
    """Per row of a chunk, the resets at or before it in the chunk (a token's reset sits on its first
    sub-step, with its decay), as fp32; zeros without resets."""
    seg = tl.zeros([C], dtype=tl.float32)
    if HAS_RESETS:
        seg = tl.cumsum(tl.load(resets + b * T + token, mask=first, other=0).to(tl.float32), 0)
    return seg


@triton.jit
def _decay_matrix(G, seg, C: tl.constexpr, HAS_RESETS: tl.constexpr):
    """D_ij = exp(G_i - G_j) on and below the diagonal within one segment, 0 elsewhere (never exp of
    a positive)."""
    i = tl.arange(0, C)
    causal = i[:, None] >= i[None, :]
    if HAS_RESETS:
        causal = causal & (seg[:, None] == seg[None, :])
    return tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))


@triton.jit
def _from_start(G, seg, HAS_RESETS: tl.constexpr):
    """exp(G) [C]: the chunk's start state's decay at each row; 0 from the chunk's first reset on."""
    decay = tl.exp(G)
    if HAS_RESETS:
        decay = tl.where(seg == 0, decay, 0.0)
    return decay


@triton.jit
def _to_end(G, G_end, seg, C: tl.constexpr, HAS_RESETS: tl.constexpr):
    """exp(G_end - G) [C]: each row's decay to the chunk's end; 0 before the chunk's last reset."""
    decay = tl.exp(G_end - G)
    if HAS_RESETS:
        decay = tl.where(seg == _last(seg, C), decay, 0.0)
    return decay


@triton.jit
def _chunk_decay(G_end, seg, C: tl.constexpr, HAS_RESETS: tl.constexpr):
    """exp(G_end): the start state's decay over the whole chunk; 0 if the chunk holds a reset."""
    decay = tl.exp(G_end)
    if HAS_RESETS:
        decay = tl.where(_last(seg, C) == 0, decay, 0.0)
    return decay


@triton.jit
def _last(x, C: tl.constexpr):
    """x[C - 1] of a length-C vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, C) == C - 1, x, 0.0), 0)


@triton.jit
def _unit_lower_inverse(A, C: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular A (C in 16, 32, 64).

    Forward substitution inside the 16 x 16 diagonal blocks, one row of every block per step
    (row i of the inverse is e_i - sum_{j<i} A_ij (row j)); then the blocks are joined: with X
    the block-diagonal inverse and N = X A_off (A's part below the diagonal blocks, so N is
    nilpotent of order C/16), (I + A)^-1 = (I + N)^-1 X = (I - N)(I + N^2) X. The products run
    in tf32x3 (about fp32 accuracy on tensor cores)."""
    i = tl.arange(0, C)
    same_block = (i[:, None] // 16) == (i[None, :] // 16)
    A_diag = tl.where(same_block, A, 0.0)
    X = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    for r in range(1, 16):
        rows = (i % 16) == r
        step = tl.dot(tl.where(rows[:, None], A_diag, 0.0), X, input_precision="tf32x3")
        X = tl.where(rows[:, None], X - step, X)
    if C > 16:
        minus_N = -tl.dot(X, tl.where(same_block, 0.0, A), input_precision="tf32x3")
        X = X + tl.dot(minus_N, X, input_precision="tf32x3")
        if C > 32:
            N_squared = tl.dot(minus_N, minus_N, input_precision="tf32x3")
            X = X + tl.dot(N_squared, X, input_precision="tf32x3")
    return X


@triton.jit
def _state_ptrs(ptr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, v_block):
    """Pointers to columns [v_block*BV, (v_block+1)*BV) of a row-major [K, V] matrix at ptr."""
    return ptr + tl.arange(0, K)[:, None] * V + v_block * BV + tl.arange(0, BV)[None, :]


# ----------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _prepare_kernel(
    k,
    v,
    g,
    beta,
    resets,
    G_out,
    W_out,
    U_out,
    Tinv_out,
    T,
    H,
    n_h,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    STORE_INVERSE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESETS: tl.constexpr,
):
    """Per chunk: cumulative decay G, the inverse Tinv, W = Tinv (beta exp(G) k) and
    U = Tinv (beta v)."""
    chunk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: large offsets
    b, h = bh // H, bh % H
    pos, token, valid, first, last = _rows(chunk, T, n_h, C)
    L = T * n_h
    k_c = _load_rows(k, b * L + pos, valid, H, h, K, NORM)
    v_c = _load_rows(v, b * L + pos, valid, H, h, V, False)
    beta_c = tl.load(beta + (b * L + pos) * H + h, mask=valid, other=0.0).to(tl.float32)
    g_c = tl.load(g + (b * T + token) * H + h, mask=first, other=0.0).to(tl.float32)
    G = tl.cumsum(g_c, 0)
    seg = _segments(resets, b, T, token, first, C, HAS_RESETS)

    i = tl.arange(0, C)
    A = tl.dot(k_c, tl.trans(k_c)) * _decay_matrix(G, seg, C, HAS_RESETS) * beta_c[:, None]
    Tinv = _unit_lower_inverse(tl.where(i[:, None] > i[None, :], A, 0.0), C)
    W = tl.dot(Tinv, k_c * (beta_c * _from_start(G, seg, HAS_RESETS))[:, None])
    U = tl.dot(Tinv, v_c * beta_c[:, None])

    row = bh * tl.num_programs(0) * C + chunk * C + i  # row in the padded [B*H, N*C] buffers
    tl.store(G_out + row, G)
    tl.store(W_out + row[:, None] * K + tl.arange(0, K)[None, :], W)
    tl.store(U_out + row[:, None] * V + tl.arange(0, V)[None, :], U)
    if STORE_INVERSE:
        tl.store(Tinv_out + row[:, None] * C + i[None, :], Tinv)


@triton.jit
def _state_kernel(
    k,
    resets,
    G_buf,
    W_buf,
    U_buf,
    initial,
    h_out,
    u_out,
    final_out,
    T,
    H,
    n_h,
    N,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESETS: tl.constexpr,
):
    """Walk the chunks in order for one (batch, head, value block): store each chunk-start state
    h[n] and the effective values u = U - W S, and the final state."""
    v_block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    L = T * n_h
    i = tl.arange(0, C)
    cols_v = v_block * BV + tl.arange(0, BV)
    if HAS_INITIAL:
        S = tl.load(_state_ptrs(initial + bh * K * V, K, V, BV, v_block)).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for n in range(N):
        tl.store(_state_ptrs(h_out + (bh * N + n) * K * V, K, V, BV, v_block), S)
        pos, token, valid, first, last = _rows(n, T, n_h, C)
        row = bh * N * C + n * C + i
        k_c = _load_rows(k, b * L + pos, valid, H, h, K, NORM)
        G = tl.load(G_buf + row)
        W = tl.load(W_buf + row[:, None] * K + tl.arange(0, K)[None, :])
        U = tl.load(U_buf + row[:, None] * V + cols_v[None, :])
        u = U - tl.dot(W, S)
        tl.store(u_out + row[:, None] * V + cols_v[None, :], u)
        G_end = _last(G, C)
        seg = _segments(resets, b, T, token, first, C, HAS_RESETS)
        S = S * _chunk_decay(G_end, seg, C, HAS_RESETS) + tl.dot(
            tl.trans(k_c * _to_end(G, G_end, seg, C, HAS_RESETS)[:, None]), u
        )
    tl.store(_state_ptrs(final_out + bh * K * V, K, V, BV, v_block), S)


@triton.jit
def _output_kernel(
    q,
    k,
    resets,
    G_buf,
    h_buf,
    u_buf,
    o,
    scale,
    T,
    H,
    n_h,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESETS: tl.constexpr,
):
    """o = (q exp(G)) S + ((q k^T) * D) u for one chunk and value block; only each token's last
    sub-step is an output row."""
    chunk, bh, v_block = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    b, h = bh // H, bh % H
    N = tl.num_programs(0)
    pos, token, valid, first, last = _rows(chunk, T, n_h, C)
    i = tl.arange(0, C)
    cols_v = v_block * BV + tl.arange(0, BV)
    row = bh * N * C + chunk * C + i
    q_c = _load_rows(q, b * T + token, last, H, h, K, NORM) * scale
    k_c = _load_rows(k, b * T * n_h + pos, valid, H, h, K, NORM)
    G = tl.load(G_buf + row)
    S = tl.load(_state_ptrs(h_buf + (bh * N + chunk) * K * V, K, V, BV, v_block))
    u = tl.load(u_buf + row[:, None] * V + cols_v[None, :])
    seg = _segments(resets, b, T, token, first, C, HAS_RESETS)
    P = tl.dot(q_c, tl.trans(k_c)) * _decay_matrix(G, seg, C, HAS_RESETS)
    o_c = tl.dot(q_c * _from_start(G, seg, HAS_RESETS)[:, None], S) + tl.dot(P, u)
    ptrs = o + ((b * T + token[:, None]) * H + h) * V + cols_v[None, :]
    tl.store(ptrs, o_c.to(o.dtype.element_ty), mask=last[:, None])


# ----------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _state_grad_kernel(
    q,
    k,
    do,
    resets,
    G_buf,
    W_buf,
    d_final,
    dh_out,
    du_out,
    d_initial,
    scale,
    T,
    H,
    n_h,
    N,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    HAS_D_FINAL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESETS: tl.constexpr,
):
    """Walk the chunks in reverse for one (batch, head, value block): dh[n] is the gradient of
    the state at chunk n's end, du the gradient of the effective values u, and what remains at
    the start is the gradient of the initial state."""
    v_block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    i = tl.arange(0, C)
    cols_v = v_block * BV + tl.arange(0, BV)
    if HAS_D_FINAL:
        dS = tl.load(_state_ptrs(d_final + bh * K * V, K, V, BV, v_block)).to(tl.float32)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for step in range(N):
        n = N - 1 - step
        tl.store(_state_ptrs(dh_out + (bh * N + n) * K * V, K, V, BV, v_block), dS)
        pos, token, valid, first, last = _rows(n, T, n_h, C)
        row = bh * N * C + n * C + i
        q_c = _load_rows(q, b * T + token, last, H, h, K, NORM) * scale
        k_c = _load_rows(k, b * T * n_h + pos, valid, H, h, K, NORM)
        do_c = tl.load(do + ((b * T + token[:, None]) * H + h) * V + cols_v[None, :], mask=last[:, None], other=0.0).to(
            tl.float32
        )
        G = tl.load(G_buf + row)
        W = tl.load(W_buf + row[:, None] * K + tl.arange(0, K)[None, :])
        G_end = _last(G, C)
        seg = _segments(resets, b, T, token, first, C, HAS_RESETS)
        P = tl.dot(q_c, tl.trans(k_c)) * _decay_matrix(G, seg, C, HAS_RESETS)
        du = tl.dot(tl.trans(P), do_c) + tl.dot(k_c * _to_end(G, G_end, seg, C, HAS_RESETS)[:, None], dS)
        tl.store(du_out + row[:, None] * V + cols_v[None, :], du)
        dS = (
            dS * _chunk_decay(G_end, seg, C, HAS_RESETS)
            + tl.dot(tl.trans(q_c * _from_start(G, seg, HAS_RESETS)[:, None]), do_c)
            - tl.dot(tl.trans(W), du)
        )
    tl.store(_state_ptrs(d_initial + bh * K * V, K, V, BV, v_block), dS)


@triton.jit
def _chunk_grad_kernel(
    q,
    k,
    v,
    beta,
    do,
    resets,
    G_buf,
    W_buf,
    Tinv_buf,
    h_buf,
    u_buf,
    dh_buf,
    du_buf,
    dq,
    dk,
    dv,
    dbeta,
    dg,
    scale,
    T,
    H,
    n_h,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESETS: tl.constexpr,
):
    """Gradients of one chunk's inputs, given its state h, its end-state gradient dh and du.

    Value-sized terms are summed over blocks of BV columns so only [C, K] and [C, C] tiles stay
    live. Names: dX is the gradient of the loss with respect to X.
    """
    chunk, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: large offsets
    b, h = bh // H, bh % H
    N = tl.num_programs(0)
    L = T * n_h
    pos, token, valid, first, last = _rows(chunk, T, n_h, C)
    i = tl.arange(0, C)
    strict = i[:, None] > i[None, :]
    row = bh * N * C + chunk * C + i
    cols_k = tl.arange(0, K)
    q_c = _load_rows(q, b * T + token, last, H, h, K, False)
    k_c = _load_rows(k, b * L + pos, valid, H, h, K, False)
    if NORM:
        q_inv_norm, k_inv_norm = _inverse_norm(q_c), _inverse_norm(k_c)
        q_c, k_c = q_c * q_inv_norm[:, None], k_c * k_inv_norm[:, None]
    q_c = q_c * scale
    beta_c = tl.load(beta + (b * L + pos) * H + h, mask=valid, other=0.0).to(tl.float32)
    G = tl.load(G_buf + row)
    W = tl.load(W_buf + row[:, None] * K + cols_k[None, :])
    Tinv = tl.load(Tinv_buf + row[:, None] * C + i[None, :])
    G_end = _last(G, C)
    seg = _segments(resets, b, T, token, first, C, HAS_RESETS)
    D = _decay_matrix(G, seg, C, HAS_RESETS)
    kk = tl.dot(k_c, tl.trans(k_c))
    qk = tl.dot(q_c, tl.trans(k_c))

    dW = tl.zeros([C, K], dtype=tl.float32)  # from u = U - W S
    dq_decayed = tl.zeros([C, K], dtype=tl.float32)  # of q exp(G), from o
    dk_to_end = tl.zeros([C, K], dtype=tl.float32)  # of k exp(G_end - G), from S_next
    dP = tl.zeros([C, C], dtype=tl.float32)  # of (q k^T) * D, from o
    dA = tl.zeros([C, C], dtype=tl.float32)  # of the system's strict lower part (negated)
    dbeta_c = tl.zeros([C], dtype=tl.float32)
    dG_end_rows = tl.zeros([K], dtype=tl.float32)  # of G_end, from exp(G_end) S, per key row
    for v_block in range(V // BV):
        cols_v = v_block * BV + tl.arange(0, BV)
        v_c = tl.load(v + ((b * L + pos[:, None]) * H + h) * V + cols_v[None, :], mask=valid[:, None], other=0.0).to(
            tl.float32
        )
        do_c = tl.load(do + ((b * T + token[:, None]) * H + h) * V + cols_v[None, :], mask=last[:, None], other=0.0).to(
            tl.float32
        )
        u = tl.load(u_buf + row[:, None] * V + cols_v[None, :])
        du = tl.load(du_buf + row[:, None] * V + cols_v[None, :])
        S = tl.load(_state_ptrs(h_buf + (bh * N + chunk) * K * V, K, V, BV, v_block))
        dS_next = tl.load(_state_ptrs(dh_buf + (bh * N + chunk) * K * V, K, V, BV, v_block))
        dW -= tl.dot(du, tl.trans(S))
        dq_decayed += tl.dot(do_c, tl.trans(S))
        dk_to_end += tl.dot(u, tl.trans(dS_next))
        dP += tl.dot(do_c, tl.trans(u))
        d_beta_v = tl.dot(tl.trans(Tinv), du)  # U = Tinv (beta v)
        dA += tl.dot(d_beta_v, tl.trans(tl.dot(Tinv, v_c * beta_c[:, None])))
        dbeta_c += tl.sum(d_beta_v * v_c, 1)
        tl.store(
            dv + ((b * L + pos[:, None]) * H + h) * V + cols_v[None, :],
            (d_beta_v * beta_c[:, None]).to(dv.dtype.element_ty),
            mask=valid[:, None],
        )
        dG_end_rows += tl.sum(dS_next * S, 1)
    d_beta_gk = tl.dot(tl.trans(Tinv), dW)  # W = Tinv (beta exp(G) k)
    dA += tl.dot(d_beta_gk, tl.trans(W))
    # d(I + A)^-1 = -Tinv^T (.) Tinv^T, folded into the two products above; A's strict part only.
    dA = tl.where(strict, -dA, 0.0)

    eG = _from_start(G, seg, HAS_RESETS)
    e_to_end = _to_end(G, G_end, seg, C, HAS_RESETS)
    kkD = tl.where(strict, kk * D, 0.0)
    dbeta_c += tl.sum(dA * kkD, 1) + tl.sum(d_beta_gk * k_c, 1) * eG
    dkk = dA * beta_c[:, None] * D
    dqk = dP * D
    dDD = (dA * beta_c[:, None] * kk + dP * qk) * D  # D's gradient times D: reaches G below

    dq_c = tl.dot(dqk, k_c) + dq_decayed * eG[:, None]
    dk_c = (
        tl.dot(dkk + tl.trans(dkk), k_c)
        + tl.dot(tl.trans(dqk), q_c)
        + dk_to_end * e_to_end[:, None]
        + d_beta_gk * (beta_c * eG)[:, None]
    )

    dG = (
        tl.sum(dq_decayed * q_c, 1) * eG
        - tl.sum(dk_to_end * k_c, 1) * e_to_end
        + tl.sum(d_beta_gk * k_c, 1) * beta_c * eG
        + tl.sum(dDD, 1)
        - tl.sum(dDD, 0)
    )
    dG_end = tl.sum(dG_end_rows, 0) * _chunk_decay(G_end, seg, C, HAS_RESETS) + tl.sum(
        tl.sum(dk_to_end * k_c, 1) * e_to_end, 0
    )
    dG += tl.where(i == C - 1, dG_end, 0.0)
    # G = cumsum(g) within the chunk, so dg_i = sum_{m >= i} dG_m.
    dg_c = tl.sum(tl.where(i[None, :] >= i[:, None], dG[None, :], 0.0), 1)

    dq_c = dq_c * scale
    if NORM:  # y = x / |x|: dx = (dy - y (y . dy)) / |x|
        q_c = q_c / scale
        dq_c = (dq_c - q_c * tl.sum(q_c * dq_c, 1)[:, None]) * q_inv_norm[:, None]
        dk_c = (dk_c - k_c * tl.sum(k_c * dk_c, 1)[:, None]) * k_inv_norm[:, None]
    _store_rows(dq, dq_c, b * T + token, last, H, h, K)
    _store_rows(dk, dk_c, b * L + pos, valid, H, h, K)
    tl.store(dbeta + (b * L + pos) * H + h, dbeta_c.to(dbeta.dtype.element_ty), mask=valid)
    tl.store(dg + (b * T + token) * H + h, dg_c.to(dg.dtype.element_ty), mask=first)


# ----------------------------------------------------------------------------------------------
# Launchers

# Value columns per program in the state, output and state-gradient kernels, and per step of
# _chunk_grad_kernel's loop; 8 warps per program. Chosen by compiling for sm_90 without a GPU
# (fewest register spills, shared memory under the 227 KiB limit; docs/LOG.md), not yet timed.
BLOCK_V = 32
GRAD_BLOCK_V = 32
NUM_WARPS = 8


def _check_dims(K, V, chunk_size):
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"triton gated_delta_product needs chunk_size 16, 32 or 64, got {chunk_size}")
    for name, d in (("head dim K", K), ("head dim V", V)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"triton gated_delta_product needs {name} a power of two >= 16, got {d}")


def _prepare(k, v, g, beta, resets, T, n_h, chunk_size, store_inverse, norm):
    B, L, H, K = k.shape
    V, C = v.shape[-1], chunk_size
    N = triton.cdiv(L, C)
    f32 = dict(device=k.device, dtype=torch.float32)
    G = torch.empty(B * H, N * C, **f32)
    W = torch.empty(B * H, N * C, K, **f32)
    U = torch.empty(B * H, N * C, V, **f32)
    Tinv = torch.empty(B * H, N * C, C, **f32) if store_inverse else G
    _prepare_kernel[(N, B * H)](
        k,
        v,
        g,
        beta,
        resets if resets is not None else G,
        G,
        W,
        U,
        Tinv,
        T,
        H,
        n_h,
        K=K,
        V=V,
        C=C,
        STORE_INVERSE=store_inverse,
        NORM=norm,
        HAS_RESETS=resets is not None,
        num_warps=NUM_WARPS,
    )
    return G, W, U, Tinv


def _states(k, resets, G, W, U, initial_state, T, n_h, chunk_size, norm):
    B, L, H, K = k.shape
    V, C = U.shape[-1], chunk_size
    N = G.shape[1] // C
    BV = min(V, BLOCK_V)
    h = torch.empty(B * H, N, K, V, device=k.device, dtype=torch.float32)
    u = torch.empty_like(U)
    final = torch.empty(B, H, K, V, device=k.device, dtype=torch.float32)
    has_initial = initial_state is not None
    _state_kernel[(V // BV, B * H)](
        k,
        resets if resets is not None else G,
        G,
        W,
        U,
        initial_state if has_initial else final,
        h,
        u,
        final,
        T,
        H,
        n_h,
        N,
        K=K,
        V=V,
        C=C,
        BV=BV,
        HAS_INITIAL=has_initial,
        NORM=norm,
        HAS_RESETS=resets is not None,
        num_warps=NUM_WARPS,
    )
    return h, u, final


def _reset_flags(resets):
    """The [B, T] bool resets as bytes the kernels load (None stays None: HAS_RESETS off)."""
    return resets.contiguous().view(torch.uint8) if resets is not None else None


def chunk_forward(q, k, v, g, beta, initial_state, n_h, scale, chunk_size, qk_l2norm, resets=None):
    """o [B, T, H, V] in q's dtype and the final state [B, H, K, V] in fp32. Inputs contiguous,
    shapes as in `gated_delta_product`; qk_l2norm: normalise q and k rows in the kernels; resets
    [B, T] bool or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    _check_dims(K, V, chunk_size)
    resets = _reset_flags(resets)
    G, W, U, _ = _prepare(k, v, g, beta, resets, T, n_h, chunk_size, False, qk_l2norm)
    h, u, final = _states(k, resets, G, W, U, initial_state, T, n_h, chunk_size, qk_l2norm)
    o = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    BV = min(V, BLOCK_V)
    _output_kernel[(h.shape[1], B * H, V // BV)](
        q,
        k,
        resets if resets is not None else G,
        G,
        h,
        u,
        o,
        scale,
        T,
        H,
        n_h,
        K=K,
        V=V,
        C=chunk_size,
        BV=BV,
        NORM=qk_l2norm,
        HAS_RESETS=resets is not None,
        num_warps=NUM_WARPS,
    )
    return o, final


def chunk_backward(do, d_final, q, k, v, g, beta, initial_state, n_h, scale, chunk_size, qk_l2norm, resets=None):
    """Gradients (dq, dk, dv, dg, dbeta, d_initial_state) from those of o and the final state.
    The chunk states are recomputed, as the forward keeps none."""
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    resets = _reset_flags(resets)
    G, W, U, Tinv = _prepare(k, v, g, beta, resets, T, n_h, C, True, qk_l2norm)
    h, u, _ = _states(k, resets, G, W, U, initial_state, T, n_h, C, qk_l2norm)
    N = h.shape[1]
    dh, du = torch.empty_like(h), torch.empty_like(u)
    d_initial = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    BV = min(V, BLOCK_V)
    has_d_final = d_final is not None
    _state_grad_kernel[(V // BV, B * H)](
        q,
        k,
        do,
        resets if resets is not None else G,
        G,
        W,
        d_final if has_d_final else d_initial,
        dh,
        du,
        d_initial,
        scale,
        T,
        H,
        n_h,
        N,
        K=K,
        V=V,
        C=C,
        BV=BV,
        HAS_D_FINAL=has_d_final,
        NORM=qk_l2norm,
        HAS_RESETS=resets is not None,
        num_warps=NUM_WARPS,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    _chunk_grad_kernel[(N, B * H)](
        q,
        k,
        v,
        beta,
        do,
        resets if resets is not None else G,
        G,
        W,
        Tinv,
        h,
        u,
        dh,
        du,
        dq,
        dk,
        dv,
        dbeta,
        dg,
        scale,
        T,
        H,
        n_h,
        K=K,
        V=V,
        C=C,
        BV=min(V, GRAD_BLOCK_V),
        NORM=qk_l2norm,
        HAS_RESETS=resets is not None,
        num_warps=NUM_WARPS,
        num_stages=1,
    )  # 1: spare shared memory
    return dq, dk, dv, dg, dbeta, d_initial
