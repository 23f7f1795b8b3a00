"""Gated DeltaProduct op: the chunked form against the token-loop oracle, and the oracle itself
against the recurrence written as explicit transition matrices. Resets (documents packed into one
row): the oracle against each segment run alone, the chunked form against the oracle, and no resets
bit for bit as before.

Tolerances (fp32): outputs, final states and every gradient agree within atol 1e-5 / rtol 1e-4;
the largest differences measured at these shapes are about 1e-5 absolute on gradients whose
entries are O(1)-O(10), and below 1.5e-6 on o and final_state.
"""

import pytest
import torch
import torch.nn.functional as F

from elr_kernels.gated_delta_product import gated_delta_product
from elr_kernels.gated_delta_product.chunk import chunk_gated_delta_product
from elr_kernels.gated_delta_product.naive import naive_gated_delta_product

ATOL, RTOL = 1e-5, 1e-4


def make_inputs(B=2, T=5, H=2, K=8, V=6, n_h=2, dtype=torch.float32, decay=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T * n_h, H, K), dim=-1)
    v = randn(B, T * n_h, H, V)
    g = decay * F.logsigmoid(randn(B, T, H))
    beta = 2 * torch.sigmoid(randn(B, T * n_h, H))
    state = randn(B, H, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta, state)]


def make_resets(B, T, starts):
    """[B, T] bool, True at each row's listed token indices (the tokens that start a new sequence)."""
    resets = torch.zeros(B, T, dtype=torch.bool)
    for row, row_starts in enumerate(starts):
        resets[row, list(row_starts)] = True
    return resets


def run_with_grads(impl, inputs, n_h, use_state, resets=None, chunk_size=None):
    """o, final_state and the gradients of a fixed random projection of both."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    if not use_state:
        inputs = inputs[:5]
    q, k, v, g, beta, *state = inputs
    o, final = gated_delta_product(
        q,
        k,
        v,
        g,
        beta,
        num_householder=n_h,
        initial_state=state[0] if state else None,
        output_final_state=True,
        impl=impl,
        resets=resets,
    )
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    return [o, final, *torch.autograd.grad(loss, inputs)]


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]


@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 37, 64, 100])
@pytest.mark.parametrize("use_state", [False, True])
def test_chunk_matches_naive(n_h, T, use_state):
    inputs = make_inputs(B=2, T=T, H=2, K=8, V=6, n_h=n_h)
    expected = run_with_grads("naive", inputs, n_h, use_state)
    actual = run_with_grads("chunk", inputs, n_h, use_state)
    for name, a, e in zip(NAMES, actual, expected):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("chunk_size", [4, 7, 16])
def test_chunk_size_does_not_matter(chunk_size):
    """Many small chunks whose edges fall inside tokens exercise the state hand-off and padding."""
    q, k, v, g, beta, state = make_inputs(B=1, T=11, H=2, K=4, V=3, n_h=3)
    args = (q, k, v, g, beta, 3, 0.5, state, True)
    o_ref, s_ref = naive_gated_delta_product(*args)
    o, s = chunk_gated_delta_product(*args, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=RTOL)


def test_strong_decay_stays_finite():
    """Decays of exp(-1000) per token must not overflow inside a chunk (forward or backward)."""
    inputs = make_inputs(B=1, T=40, H=2, K=4, V=4, n_h=2, decay=1000.0)
    expected = run_with_grads("naive", inputs, 2, True)
    actual = run_with_grads("chunk", inputs, 2, True)
    for name, a, e in zip(NAMES, actual, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


# (n_h, T, starts per row): resets on the first token (the initial state is dropped), on adjacent
# tokens, on the last token, and, with 64-row chunks, at and beside chunk edges (expanded rows 64, 128).
RESET_CASES = [
    (1, 40, [[0, 5, 6, 39], [17]]),
    (2, 70, [[31, 32, 33], [0, 64]]),
    (3, 50, [[1, 21, 22, 43], [10, 49]]),
]


@pytest.mark.parametrize("case", RESET_CASES, ids=lambda c: f"n_h{c[0]}")
def test_naive_with_resets_runs_each_segment_alone(case):
    """The oracle's meaning: with resets, each segment's outputs are those of the segment run by itself
    from a zero state (the first from the initial state unless token 0 resets), and the final state is
    the last segment's."""
    n_h, T, starts = case
    q, k, v, g, beta, state = make_inputs(B=2, T=T, H=2, K=4, V=3, n_h=n_h, dtype=torch.float64)
    o, final = gated_delta_product(
        q,
        k,
        v,
        g,
        beta,
        num_householder=n_h,
        initial_state=state,
        output_final_state=True,
        impl="naive",
        resets=make_resets(2, T, starts),
    )
    for row, row_starts in enumerate(starts):
        bounds = sorted({0, *row_starts, T})
        for a, b in zip(bounds[:-1], bounds[1:]):
            sub = slice(a * n_h, b * n_h)
            alone, alone_final = gated_delta_product(
                q[row : row + 1, a:b],
                k[row : row + 1, sub],
                v[row : row + 1, sub],
                g[row : row + 1, a:b],
                beta[row : row + 1, sub],
                num_householder=n_h,
                initial_state=None if a in row_starts else state[row : row + 1],
                output_final_state=True,
                impl="naive",
            )
            torch.testing.assert_close(o[row : row + 1, a:b], alone, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(final[row : row + 1], alone_final, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("case", RESET_CASES, ids=lambda c: f"n_h{c[0]}")
@pytest.mark.parametrize("decay", [1.0, 1000.0])
def test_chunk_with_resets_matches_naive(case, decay):
    """Forward and every gradient (the decay of a reset token reaches nothing: its gradient is 0), finite
    under decays of exp(-1000) per token."""
    n_h, T, starts = case
    inputs = make_inputs(B=2, T=T, H=2, K=8, V=6, n_h=n_h, decay=decay)
    resets = make_resets(2, T, starts)
    expected = run_with_grads("naive", inputs, n_h, True, resets)
    actual = run_with_grads("chunk", inputs, n_h, True, resets)
    for name, a, e in zip(NAMES, actual, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
    dg = actual[NAMES.index("dg")]
    assert dg[resets].abs().max() < ATOL


@pytest.mark.parametrize("chunk_size", [4, 7])
def test_chunk_with_resets_at_chunk_edges(chunk_size):
    """Many small chunks: resets on a chunk's first row, inside, and on its last."""
    q, k, v, g, beta, state = make_inputs(B=1, T=13, H=2, K=4, V=3, n_h=2)
    resets = make_resets(1, 13, [[2, 3, 6, 7, 12]])
    args = (q, k, v, g, beta, 2, 0.5, state, True)
    o_ref, s_ref = naive_gated_delta_product(*args, resets=resets)
    o, s = chunk_gated_delta_product(*args, chunk_size=chunk_size, resets=resets)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", ["naive", "chunk"])
def test_no_resets_is_bit_identical_to_all_false(impl):
    """resets=None is the op as it was; all-False resets compute the same bits (forward and backward)."""
    inputs = make_inputs(B=2, T=37, H=2, K=8, V=6, n_h=2)
    without = run_with_grads(impl, inputs, 2, True)
    all_false = run_with_grads(impl, inputs, 2, True, torch.zeros(2, 37, dtype=torch.bool))
    for name, a, e in zip(NAMES, all_false, without):
        assert torch.equal(a, e), name


def transition_matrix_reference(q, k, v, g, beta, n_h, scale, state):
    """S <- exp(g) S, then S <- (I - beta k k^T) S + beta k v^T per sub-step: same recurrence,
    different algebra, one (batch, head) at a time in fp64."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    final = state.clone()
    for b in range(B):
        for h in range(H):
            S = state[b, h].clone()
            for t in range(T):
                S = torch.exp(g[b, t, h]) * S
                for j in range(n_h):
                    kj, vj, bj = k[b, t * n_h + j, h], v[b, t * n_h + j, h], beta[b, t * n_h + j, h]
                    S = (torch.eye(K, dtype=torch.float64) - bj * torch.outer(kj, kj)) @ S + bj * torch.outer(kj, vj)
                o[b, t, h] = scale * (S.T @ q[b, t, h])
            final[b, h] = S
    return o, final


@pytest.mark.parametrize("n_h", [1, 2])
def test_naive_matches_transition_matrices(n_h):
    q, k, v, g, beta, state = make_inputs(B=2, T=6, H=2, K=3, V=2, n_h=n_h, dtype=torch.float64)
    o_ref, s_ref = transition_matrix_reference(q, k, v, g, beta, n_h, 0.7, state)
    o, s = gated_delta_product(
        q, k, v, g, beta, num_householder=n_h, scale=0.7, initial_state=state, output_final_state=True, impl="naive"
    )
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=1e-12)


def test_naive_single_step_by_hand():
    """One token, one sub-step, zero state: S = beta k v^T, so o = scale * beta (q . k) v."""
    q, k, v, g, beta, _ = make_inputs(B=1, T=1, H=1, K=4, V=3, n_h=1)
    o, s = gated_delta_product(q, k, v, g, beta, num_householder=1, output_final_state=True, impl="naive")
    qk = (q[0, 0, 0] * k[0, 0, 0]).sum()
    torch.testing.assert_close(o[0, 0, 0], 0.5 * beta[0, 0, 0] * qk * v[0, 0, 0])
    torch.testing.assert_close(s[0, 0], beta[0, 0, 0] * torch.outer(k[0, 0, 0], v[0, 0, 0]))


def test_default_scale_and_no_final_state():
    q, k, v, g, beta, _ = make_inputs(B=1, T=3, H=1, K=16, V=4, n_h=2)
    o_default, final = gated_delta_product(q, k, v, g, beta, num_householder=2)
    o_explicit, _ = gated_delta_product(q, k, v, g, beta, num_householder=2, scale=0.25)
    assert final is None
    torch.testing.assert_close(o_default, o_explicit)


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    q, k, v, g, beta, state = make_inputs(B=1, T=9, H=2, K=8, V=4, n_h=2, dtype=torch.bfloat16)
    o, final = gated_delta_product(q, k, v, g, beta, num_householder=2, initial_state=state, output_final_state=True)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 9, 2, 4)
    assert final.dtype == torch.float32 and final.shape == (1, 2, 8, 4)


def test_invalid_inputs_raise():
    q, k, v, g, beta, state = make_inputs(B=1, T=4, H=2, K=8, V=4, n_h=2)
    with pytest.raises(ValueError, match="impl"):
        gated_delta_product(q, k, v, g, beta, num_householder=2, impl="triton_typo")
    with pytest.raises(ValueError, match="num_householder"):
        gated_delta_product(q, k, v, g, beta, num_householder=0)
    with pytest.raises(ValueError, match="k has shape"):
        gated_delta_product(q, k, v, g, beta, num_householder=3)  # k holds 2 sub-steps per token
    with pytest.raises(ValueError, match="g has shape"):
        gated_delta_product(q, k, v, g[:, :3], beta, num_householder=2)
    with pytest.raises(ValueError, match="beta has shape"):
        gated_delta_product(q, k, v, g, beta[..., None], num_householder=2)
    with pytest.raises(ValueError, match="initial_state has shape"):
        gated_delta_product(q, k, v, g, beta, num_householder=2, initial_state=state.mT)
    with pytest.raises(ValueError, match="resets must be a bool tensor"):
        gated_delta_product(q, k, v, g, beta, num_householder=2, resets=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="resets must be a bool tensor"):
        gated_delta_product(q, k, v, g, beta, num_householder=2, resets=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="q must be"):
        gated_delta_product(q[0], k, v, g, beta, num_householder=2)
