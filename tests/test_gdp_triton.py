"""Triton gated DeltaProduct kernels against the token-loop oracle, on CPU under the interpreter.

TRITON_INTERPRET=1 only takes effect if set before triton is first imported, and other tests in
the same pytest process may import it earlier (torch.compile does), so on a machine without CUDA
`test_kernels_under_interpreter` re-runs this file in a fresh process with the variable set; the
kernel tests skip in the outer process. On CUDA they run directly, with the kernels' fp32 dots in
IEEE fp32 rather than TF32 (TRITON_F32_DEFAULT=ieee, as scripts/gpu_check.sh sets it). Shapes are
tiny and the chunk size lowered to 16 (the interpreter costs milliseconds per program instance);
everything is fp32, as the interpreter computes bf16 wrongly. Tolerances as in test_gdp_op.py:
atol 1e-5, rtol 1e-4. bf16 on a GPU is checked by scripts/check_gdp_triton.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from test_gdp_op import NAMES, make_inputs, make_resets  # noqa: E402

from elr_kernels.gated_delta_product import (  # noqa: E402
    gated_delta_product,
    gated_delta_product_step,
    triton_chunk,  # noqa: E402
)
from elr_kernels.gated_delta_product.triton_op import triton_gated_delta_product  # noqa: E402

ATOL, RTOL = 1e-5, 1e-4
RUNS_KERNELS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernel_test = pytest.mark.skipif(not RUNS_KERNELS, reason="run by test_kernels_under_interpreter")


@pytest.mark.slow
@pytest.mark.skipif(RUNS_KERNELS, reason="the kernel tests run in this process")
def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def grads_of(fn, inputs, n_h, use_state, seed=1):
    """o, final_state (when use_state) and the gradients of a fixed random projection of them.
    Without initial state the final state is not returned, so its gradient path sees None."""
    inputs = [x.detach().clone().to(DEVICE).requires_grad_() for x in inputs]
    if not use_state:
        inputs = inputs[:5]
    q, k, v, g, beta, *state = inputs
    o, final = fn(q, k, v, g, beta, state[0] if state else None, use_state)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen).to(DEVICE)).sum()
    outputs = [o]
    if use_state:
        loss = loss + (final * torch.randn(final.shape, generator=gen).to(DEVICE)).sum()
        outputs.append(final)
    return outputs + list(torch.autograd.grad(loss, inputs))


def assert_all_close(actual, expected, names):
    for name, a, e in zip(names, actual, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


def names_for(use_state):
    return NAMES if use_state else [n for n in NAMES if n not in ("final_state", "dinitial_state")]


# (n_h, B, T, K, V, decay, chunk): expanded lengths 45, 74 and 69, none a multiple of the chunk, so
# chunk edges fall inside tokens for n_h = 2, 3; decay 1000 makes exp(G) underflow inside chunks;
# chunk 32 joins two diagonal blocks in the inverse (chunk 64, four, in the tests further down).
CASES = [(1, 2, 45, 16, 32, 1.0, 16), (2, 1, 37, 32, 16, 1.0, 16), (3, 2, 23, 16, 16, 1000.0, 32)]


@kernel_test
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n_h{c[0]}")
@pytest.mark.parametrize("use_state", [False, True])
def test_forward_backward_match_naive(case, use_state):
    n_h, B, T, K, V, decay, chunk = case
    inputs = make_inputs(B=B, T=T, H=2, K=K, V=V, n_h=n_h, decay=decay)

    def run(impl):
        def fn(q, k, v, g, beta, state, final):
            if impl == "triton":
                return triton_gated_delta_product(q, k, v, g, beta, n_h, 0.3, state, final, chunk_size=chunk)
            return gated_delta_product(
                q,
                k,
                v,
                g,
                beta,
                num_householder=n_h,
                scale=0.3,
                initial_state=state,
                output_final_state=final,
                impl=impl,
            )

        return fn

    expected = grads_of(run("naive"), inputs, n_h, use_state)
    actual = grads_of(run("triton"), inputs, n_h, use_state)
    assert_all_close([a.cpu() for a in actual], [e.cpu() for e in expected], names_for(use_state))


# (n_h, T, starts per row, decay, chunk): with chunk 16, expanded rows 16 and 32 are chunk edges
# (n_h = 2: tokens 8 and 16); token 0 resets (the initial state is dropped); adjacent and last-token
# resets; decay 1000 with a reset inside a chunk whose exp(G) has underflowed.
RESET_CASES = [(2, 23, [[0, 7, 8, 16], [13, 22]], 1.0, 16), (3, 23, [[5, 6], [1, 11, 21]], 1000.0, 32)]


@kernel_test
@pytest.mark.parametrize("case", RESET_CASES, ids=lambda c: f"n_h{c[0]}")
def test_resets_forward_backward_match_naive(case):
    n_h, T, starts, decay, chunk = case
    inputs = make_inputs(B=2, T=T, H=2, K=16, V=16, n_h=n_h, decay=decay)
    resets = make_resets(2, T, starts)

    def run(impl):
        def fn(q, k, v, g, beta, state, final):
            r = resets.to(q.device)
            if impl == "triton":
                return triton_gated_delta_product(q, k, v, g, beta, n_h, 0.3, state, final, chunk_size=chunk, resets=r)
            return gated_delta_product(
                q,
                k,
                v,
                g,
                beta,
                num_householder=n_h,
                scale=0.3,
                initial_state=state,
                output_final_state=final,
                impl=impl,
                resets=r,
            )

        return fn

    expected = grads_of(run("naive"), inputs, n_h, True)
    actual = grads_of(run("triton"), inputs, n_h, True)
    assert_all_close([a.cpu() for a in actual], [e.cpu() for e in expected], NAMES)


@kernel_test
def test_no_resets_is_bit_identical_to_all_false():
    """resets=None runs the kernels as they were (HAS_RESETS off); all-False resets give the same bits."""
    inputs = make_inputs(B=1, T=21, H=2, K=16, V=16, n_h=2)

    def run(resets):
        def fn(q, k, v, g, beta, state, final):
            return triton_gated_delta_product(q, k, v, g, beta, 2, 0.3, state, final, chunk_size=16, resets=resets)

        return fn

    without = grads_of(run(None), inputs, 2, True)
    all_false = grads_of(run(torch.zeros(1, 21, dtype=torch.bool, device=DEVICE)), inputs, 2, True)
    for name, a, e in zip(NAMES, all_false, without):
        assert torch.equal(a, e), name


@kernel_test
def test_value_blocks_and_in_kernel_l2norm(monkeypatch):
    """Several value blocks in every kernel, the public entry, and q/k normalised in the kernels
    (inputs not unit length) against l2_normalize in front of the oracle."""
    monkeypatch.setattr(triton_chunk, "BLOCK_V", 16)
    monkeypatch.setattr(triton_chunk, "GRAD_BLOCK_V", 16)
    q, k, v, g, beta, state = make_inputs(B=1, T=21, H=2, K=16, V=32, n_h=2)
    inputs = [3 * q, 0.5 * k, v, g, beta, state]

    def run(impl):
        def fn(q, k, v, g, beta, state, final):
            return gated_delta_product(
                q,
                k,
                v,
                g,
                beta,
                num_householder=2,
                initial_state=state,
                output_final_state=final,
                use_qk_l2norm=True,
                impl=impl,
            )

        return fn

    expected = grads_of(run("naive"), inputs, 2, True)
    actual = grads_of(run("triton"), inputs, 2, True)
    assert_all_close([a.cpu() for a in actual], [e.cpu() for e in expected], NAMES)


@kernel_test
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_decode_matches_naive_token_by_token(use_qk_l2norm):
    n_h, T = 2, 5
    q, k, v, g, beta, state = make_inputs(B=2, T=T, H=2, K=16, V=32, n_h=n_h)
    o_ref, final_ref = gated_delta_product(
        q,
        k,
        v,
        g,
        beta,
        num_householder=n_h,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm=use_qk_l2norm,
        impl="naive",
    )
    S = state.to(DEVICE)
    for t in range(T):
        sub = slice(t * n_h, (t + 1) * n_h)
        o_t, S = gated_delta_product_step(
            q[:, t : t + 1].to(DEVICE),
            k[:, sub].to(DEVICE),
            v[:, sub].to(DEVICE),
            g[:, t : t + 1].to(DEVICE),
            beta[:, sub].to(DEVICE),
            S,
            num_householder=n_h,
            use_qk_l2norm=use_qk_l2norm,
            impl="triton",
        )
        torch.testing.assert_close(o_t.cpu(), o_ref[:, t : t + 1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(S.cpu(), final_ref, atol=ATOL, rtol=RTOL)


@kernel_test
def test_custom_op_registrations():
    """Schema, fake tensor, autograd registration and AOT dispatch checks of torch.library, with
    q and k non-contiguous (same values, heads-first memory), as a layer's reshapes can give."""
    q, k, v, g, beta, state = (x.to(DEVICE) for x in make_inputs(B=1, T=5, H=2, K=16, V=16, n_h=2))
    q, k = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k))
    q, k, v, g, beta, state = (x.requires_grad_() for x in (q, k, v, g, beta, state))
    torch.library.opcheck(torch.ops.elr.gated_delta_product.default, (q, k, v, g, beta, state, 2, 0.25, 16, False))
    resets = make_resets(1, 5, [[0, 3]]).to(DEVICE)
    torch.library.opcheck(
        torch.ops.elr.gated_delta_product.default, (q, k, v, g, beta, state, 2, 0.25, 16, False, resets)
    )


@kernel_test
def test_compiled_gdp_layer_has_no_graph_break():
    """torch.compile traces the whole GDP layer through the custom op, and the compiled layer
    (aot_eager: the op's fake and autograd registrations at work) matches eager."""
    from elr.models.args import ModelArgs
    from elr.models.gdp import GatedDeltaProduct

    args = ModelArgs(dim=32, layer_pattern="G", partition=(1, 0, 0), gdp_heads=2, gdp_head_dim=16, gdp_impl="triton")
    torch.manual_seed(0)
    layer = GatedDeltaProduct(args).to(DEVICE)
    with torch.no_grad():
        layer.init_weights(out_std=0.02)
    x = torch.randn(1, 20, 32, device=DEVICE)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    def loss_and_grads(module):
        loss = module(x).square().sum()
        return [loss, *torch.autograd.grad(loss, list(layer.parameters()))]

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for a, e in zip(loss_and_grads(compiled), loss_and_grads(layer)):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL)


@kernel_test
@pytest.mark.parametrize("save_gdp_output", [False, True])
def test_selective_checkpointing_can_save_the_op_output(monkeypatch, save_gdp_output):
    """With the op in the SAC save list, the backward does not run the GDP forward again."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from elr.models.args import ModelArgs
    from elr.models.gdp import GatedDeltaProduct
    from elr_kernels.gated_delta_product import triton_op

    forward_calls = []

    def counting_forward(*args):
        forward_calls.append(1)
        return triton_chunk.chunk_forward(*args)

    monkeypatch.setattr(triton_op, "chunk_forward", counting_forward)
    args = ModelArgs(dim=32, layer_pattern="G", partition=(1, 0, 0), gdp_heads=2, gdp_head_dim=16, gdp_impl="triton")
    layer = GatedDeltaProduct(args).to(DEVICE)
    with torch.no_grad():
        layer.init_weights(out_std=0.02)
    x = torch.randn(1, 12, 32, device=DEVICE, requires_grad=True)
    saved = [torch.ops.elr.gated_delta_product.default] if save_gdp_output else []
    context_fn = functools.partial(create_selective_checkpoint_contexts, saved)
    checkpoint(layer, x, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert len(forward_calls) == (1 if save_gdp_output else 2)
    assert torch.isfinite(x.grad).all()


@kernel_test
def test_decoding_takes_the_triton_step_and_equals_the_full_forward(monkeypatch):
    """A model with gdp_impl = "triton" decodes one token at a time through the one-token kernel,
    and the logits equal its full-sequence forward."""
    import elr_kernels.gated_delta_product as gdp_op
    from elr.infer.cache import InferenceCache
    from elr.models import build_model
    from elr.models.args import ModelArgs

    steps = []
    kernel = gdp_op.triton_gated_delta_product_step
    monkeypatch.setattr(gdp_op, "triton_gated_delta_product_step", lambda *a, **kw: steps.append(1) or kernel(*a, **kw))
    args = ModelArgs(
        dim=32,
        layer_pattern="GG",
        partition=(1, 1, 0),
        vocab_size=16,
        max_seq_len=16,
        gdp_heads=2,
        gdp_head_dim=16,
        gdp_impl="triton",
    ).with_recurrence(max_loops=2)
    torch.manual_seed(0)
    model = build_model(args).to(DEVICE)
    model.init_weights()
    tokens = torch.randint(0, 16, (2, 7), device=DEVICE)
    with torch.no_grad():
        full = model(tokens, loops=2)
        cache = InferenceCache(model, 2, 7, 2, "per_loop")
        chunks = [model(tokens[:, :4], 2, cache)] + [model(tokens[:, t : t + 1], 2, cache) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=RTOL)
    assert len(steps) == 3 * 3  # three decoded tokens, each through three GDP calls (one input, two loops)


@kernel_test
def test_unsupported_head_dim_raises():
    q, k, v, g, beta, _ = make_inputs(B=1, T=3, H=1, K=12, V=16, n_h=2)
    with pytest.raises(ValueError, match="head dim K"):
        gated_delta_product(q, k, v, g, beta, num_householder=2, impl="triton")
