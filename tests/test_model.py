"""The model: shapes and parameter counts, ELR identities at initialisation, FLOP accounting."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode
from trainer_utils import model_args

import elr.models.gdp as gdp_module
from elr.models import build_model, flavors
from elr.models.attention import apply_partial_rope, rope_table
from elr.models.layers import Layer
from elr_kernels.gated_delta_product import gated_delta_product

# A flavor is a backbone; ModelArgs' ELR defaults make it the non-recurrent baseline.
BASELINE = flavors["debug"]
DEBUG = model_args(BASELINE, max_loops=3, update="adaptive_delta")  # ELR, unconditioned


def make(seed=0, base=DEBUG, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(model_args(base, max_seq_len=64, **overrides))
    model.init_weights()
    return model


def tokens(B=2, T=24, seed=1):
    return torch.randint(0, DEBUG.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def copy_shared_weights(src, dst):
    """Load src's parameters into dst; only keys dst lacks may be missing (e.g. ELR-only modules)."""
    dst_keys = set(dst.state_dict())
    dst.load_state_dict({k: v for k, v in src.state_dict().items() if k in dst_keys}, strict=False)


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("gpt_0p5b", (0.45e9, 0.55e9), None),
        ("gdp_hybrid_4b", (3.6e9, 4.4e9), None),
        ("koi_4b", (3.6e9, 4.4e9), None),
        ("gdp_hybrid_30b_a3b", (27e9, 33e9), (3e9, 4e9)),
    ],
)
def test_flavor_parameter_counts(name, total, active):
    args = flavors[name]
    with torch.device("meta"):
        model = build_model(args)
    n = sum(p.numel() for p in model.parameters())
    assert total[0] <= n <= total[1], f"{name}: {n / 1e9:.3f}B parameters"
    if active is not None:
        experts = sum(m.w1.numel() + m.w2.numel() for m in model.moe_layers())
        n_active = n - experts + experts * args.moe_top_k / args.moe_experts
        assert active[0] <= n_active <= active[1], f"{name}: {n_active / 1e9:.3f}B active"


@pytest.mark.parametrize("name", ["gpt_0p5b", "gdp_hybrid_4b", "koi_4b", "gdp_hybrid_30b_a3b"])
def test_flavor_layer_counts_match_paper_table(name):
    expected = {
        "gpt_0p5b": (0, 15, 15, (8, 14, 8)),
        "gdp_hybrid_4b": (23, 6, 23, (14, 24, 14)),
        "koi_4b": (23, 6, 23, (14, 24, 14)),
        "gdp_hybrid_30b_a3b": (23, 6, 23, (14, 24, 14)),
    }[name]
    p = flavors[name].layer_pattern
    assert (p.count("G"), p.count("A"), p.count("F") + p.count("E")) == expected[:3]
    assert flavors[name].partition == expected[3]


def test_koi_has_three_recurrent_attention_layers():
    a = flavors["koi_4b"]
    n_in, n_rec, _ = a.partition
    assert a.layer_pattern[n_in : n_in + n_rec].count("A") == 3


def test_debug_flavor_has_every_layer_kind_in_the_recurrent_block():
    n_in, n_rec, _ = DEBUG.partition
    assert set(DEBUG.layer_pattern[n_in : n_in + n_rec]) == set("GAFE")


def test_meta_build_then_init_materialises_everything():
    with torch.device("meta"):
        model = build_model(model_args(DEBUG, max_seq_len=64, conditioning=True))
    model.to_empty(device="cpu")
    model.init_weights()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(t).all(), name
    assert torch.equal(model.rope, rope_table(16, 64, DEBUG.rope_theta))
    assert model(tokens(), loops=3).shape == (2, 24, DEBUG.vocab_size)


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_each_unique_layer_runs_once_at_k1_and_recurrent_layers_k_times(loops):
    model = make()
    calls = {}
    for name, m in model.named_modules():
        if isinstance(m, Layer):
            m.register_forward_hook(lambda mod, args, out, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    model(tokens(), loops=loops)
    assert len(calls) == len(DEBUG.layer_pattern)
    for name, n in calls.items():
        assert n == (loops if name.startswith("recurrent.") else 1), name


@pytest.mark.parametrize("recurrent_input", ["state", "state_plus_input"])
@pytest.mark.parametrize("update", ["adaptive_delta", "replace"])
def test_one_loop_elr_equals_non_recurrent_baseline_at_init(update, recurrent_input):
    elr = make(update=update, recurrent_input=recurrent_input)
    baseline = make(seed=7, base=BASELINE)
    copy_shared_weights(elr, baseline)
    x = tokens()
    assert torch.equal(elr(x, loops=1), baseline(x, loops=1))
    # ... and the ELR model really has extra, ELR-only parameters when the update is learned
    extra = set(elr.state_dict()) - set(baseline.state_dict())
    assert bool(extra) == (update == "adaptive_delta")


def reference_logits(model, x, loops):
    """The loop of docs/DESIGN.md §3.3 written out from the model's own layers (no conditioning)."""
    a = model.args
    rope = model.rope[:, : x.shape[1]]
    h = model.tok_embeddings(x)
    for layer in model.input_layers:
        h = layer(h, rope)
    s = h_in = h
    for i in range(1, loops + 1):
        s_in = s + h_in if a.recurrence.recurrent_input == "state_plus_input" and i >= 2 else s
        r = s_in
        for layer in model.recurrent.layers:
            r = layer(r, rope)
        if a.recurrence.update == "replace":
            s = r
        elif a.recurrence.update == "residual":
            s = s + r
        else:
            step = model.recurrent.step_size
            a_i = 2 * torch.sigmoid(step.proj(step.norm(s_in)))  # the default step_input = "state"
            s = s + a_i * (r - s)
    for layer in model.output_layers:
        s = layer(s, rope)
    return model.output(model.norm(s))


@pytest.mark.parametrize("recurrent_input", ["state", "state_plus_input"])
@pytest.mark.parametrize("update", ["adaptive_delta", "replace", "residual"])
def test_update_rules_and_reinjection_follow_their_formulas(update, recurrent_input):
    model = make(update=update, recurrent_input=recurrent_input)
    if update == "adaptive_delta":  # move the step off its initial 1 so the rule is really tested
        torch.nn.init.normal_(model.recurrent.step_size.proj.weight, std=0.05)
    x = tokens()
    with torch.no_grad():
        for k in (1, 2, 3):
            torch.testing.assert_close(model(x, loops=k), reference_logits(model, x, k), rtol=1e-5, atol=1e-5)


def test_residual_addition_is_not_replacement():
    """Figure 4a's two parameter-free rules are two networks: same weights, other logits at k >= 2
    (and at k = 1, where residual's s_1 = h_in + r_1 is not the plain stack)."""
    x = tokens()
    replace, residual = make(update="replace"), make(update="residual")
    assert set(replace.state_dict()) == set(residual.state_dict())
    copy_shared_weights(replace, residual)
    for k in (1, 2, 3):
        assert not torch.allclose(replace(x, loops=k), residual(x, loops=k), rtol=1e-3, atol=1e-3), k


def test_reinjection_leaves_one_loop_alone_and_changes_later_loops():
    x = tokens()
    state, reinjected = make(), make(recurrent_input="state_plus_input")
    assert torch.equal(state(x, loops=1), reinjected(x, loops=1))
    for k in (2, 3):
        assert not torch.allclose(state(x, loops=k), reinjected(x, loops=k)), k


def test_conditioned_model_refuses_loop_counts_its_embeddings_do_not_cover():
    with pytest.raises(ValueError, match="outside 1..3"):
        make(conditioning=True)(tokens(), loops=4)
    with pytest.raises(ValueError, match="outside 1..3"):
        make(conditioning=True)(tokens(), loops=0)


def test_unconditioned_model_extrapolates_past_max_loops():
    """Nothing limits an unconditioned block to 1..K: k = K + 1 is one more loop of the same block."""
    model, x = make(conditioning=False), tokens()
    with torch.no_grad():
        model.recurrent.step_size.proj.bias.fill_(0.5)  # a step other than 1, so loops differ
        assert not torch.allclose(model(x, loops=3), model(x, loops=4))
        assert torch.isfinite(model(x, loops=6)).all()
    with pytest.raises(ValueError, match="outside"):
        make(base=BASELINE)(x, loops=0)


@pytest.mark.parametrize("recurrent_input", ["state", "state_plus_input"])
def test_conditioning_is_exactly_invisible_at_init_for_every_k(recurrent_input):
    conditioned = make(conditioning=True, recurrent_input=recurrent_input)
    plain = make(seed=3, conditioning=False, recurrent_input=recurrent_input)
    copy_shared_weights(conditioned, plain)
    x = tokens()
    for k in range(1, DEBUG.recurrence.max_loops + 1):
        assert torch.equal(conditioned(x, loops=k), plain(x, loops=k)), k


def test_conditioning_heads_get_gradients_at_init():
    model = make(conditioning=True)
    x = tokens()
    F.cross_entropy(model(x, loops=2).flatten(0, 1), x.flatten()).backward()
    for head in model.recurrent.conditioning.heads:
        assert head.weight.grad.abs().sum() > 0 and head.bias.grad.abs().sum() > 0


def test_loops_change_the_output():
    x = tokens()
    model = make()
    assert not torch.allclose(model(x, loops=1), model(x, loops=2))


def test_model_is_causal():
    model = make(conditioning=True)
    x = tokens(B=1, T=20)
    y = x.clone()
    y[0, 12] = (y[0, 12] + 1) % DEBUG.vocab_size
    a, b = model(x, loops=3), model(y, loops=3)
    # not bit-exact: the MoE groups tokens by expert, so matmul shapes differ between the runs
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gdp_layer_chunk_equals_naive():
    x = torch.randn(2, 40, DEBUG.dim)
    chunk = make().input_layers[0]
    naive = make(gdp_impl="naive").input_layers[0]
    naive.load_state_dict(chunk.state_dict())
    torch.testing.assert_close(chunk(x, None), naive(x, None), rtol=1e-4, atol=1e-5)


def test_partial_rope_rotates_half_the_dims_and_keeps_relative_positions():
    D, T = 32, 10
    rope = rope_table(16, T, 10000.0)
    q, k = torch.randn(1, T, 1, D), torch.randn(1, T, 1, D)
    qr = apply_partial_rope(q, rope)
    assert torch.equal(qr[..., 16:], q[..., 16:])
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1))
    # same vectors at every position: the score depends only on the distance between positions
    q1, k1 = q[:, :1].expand(1, T, 1, D), k[:, :1].expand(1, T, 1, D)
    scores = apply_partial_rope(q1, rope)[0, :, 0] @ apply_partial_rope(k1, rope)[0, :, 0].T
    torch.testing.assert_close(scores[5, 3], scores[7, 5])
    torch.testing.assert_close(scores[9, 0], scores[10 - 1, 0])
    assert not torch.allclose(scores[5, 3], scores[5, 4])


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *args, **kwargs: (
        flop_counter.sdpa_flop_count(q, k, v)
    ),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda grad_out, q, k, v, *args, **kwargs: (
        flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)
    ),
}


def _training_flops(model, x, loops):
    """Counted matmul and attention FLOPs; convolutions are left out, as in the model's count."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        F.cross_entropy(model(x, loops=loops).flatten(0, 1), x.flatten()).backward()
    counts = counter.get_flop_counts()["Global"]
    return sum(n for op, n in counts.items() if "convolution" not in str(op))


def test_flops_per_token_matches_counted_flops(monkeypatch):
    """FlopCounterMode counts every matmul, convolution and attention of forward + backward.

    The GDP recurrence is swapped for a stand-in without matmuls here, and its state-update term
    is checked separately against the naive oracle below.
    """

    def no_state_recurrence(q, k, v, g, beta, *, num_householder, **kwargs):
        every_input = (q.sum() + k.sum() + g.sum() + beta.sum()) * 0  # so every projection gets a gradient
        return v[:, num_householder - 1 :: num_householder] + every_input, None

    monkeypatch.setattr(gdp_module, "gated_delta_product", no_state_recurrence)
    a = DEBUG
    H, D, n_h = a.gdp_heads, a.gdp_head_dim, a.gdp_householder
    state_term = 6 * H * (2 * n_h + 1) * D * D
    B, T = 2, 16
    # Flash-attention backward recomputes the scores QK^T; the model's count follows the usual
    # MFU convention (12 * heads * head_dim * seq_len per attention layer) and leaves that out.
    recompute_term = 2 * a.n_heads * a.head_dim * T
    x = tokens(B, T)
    # Integer-exact: the conditioning heads run once per sequence, so they are kept off here.
    model = make(conditioning=False)
    n_in, n_rec, _ = a.partition
    recurrent = a.layer_pattern[n_in : n_in + n_rec]
    for loops in (1, 2, 3):
        n_gdp = a.layer_pattern.count("G") + (loops - 1) * recurrent.count("G")
        n_attention = a.layer_pattern.count("A") + (loops - 1) * recurrent.count("A")
        expected = model.num_flops_per_token(T, loops) - n_gdp * state_term + n_attention * recompute_term
        counted = _training_flops(model, x, loops) / (B * T)
        assert counted == expected, loops


def test_gdp_state_flops_match_the_naive_recurrence():
    a = DEBUG
    H, D, n_h = a.gdp_heads, a.gdp_head_dim, a.gdp_householder
    B, T = 1, 8
    q = F.normalize(torch.randn(B, T, H, D), dim=-1)
    k = F.normalize(torch.randn(B, T * n_h, H, D), dim=-1)
    v, beta, g = torch.randn(B, T * n_h, H, D), torch.rand(B, T * n_h, H), -torch.rand(B, T, H)
    with FlopCounterMode(display=False) as counter:
        gated_delta_product(q, k, v, g, beta, num_householder=n_h, impl="naive")
    # the term test_flops_per_token_matches_counted_flops subtracts from the model's count
    assert 3 * counter.get_total_flops() / (B * T) == 6 * H * (2 * n_h + 1) * D * D


def test_flops_grow_linearly_with_loops():
    model = make()
    f1, f2, f3 = (model.num_flops_per_token(128, k) for k in (1, 2, 3))
    assert f3 - f2 == f2 - f1 > 0
    # every_loop runs the output block and head after each loop: each loop adds them too
    e1, e2, e3 = (model.num_flops_per_token(128, k, every_loop=True) for k in (1, 2, 3))
    assert e1 == f1 and e3 - e2 == e2 - e1 > f2 - f1


def perturb_conditioning(model):
    """Non-zero FiLM heads (the loops' and the output block's), so the conditioning is visible (at
    init it is exactly zero)."""
    c = model.recurrent.conditioning
    with torch.no_grad():
        for head in [*c.heads, *c.exit_heads]:
            head.weight.normal_(std=0.5)
            head.bias.normal_(std=0.1)
    return model


def test_every_loop_forward_is_the_model_at_each_budget():
    """Without the budget embedding the first i loops of a k-loop forward are the i-loop model, so
    every_loop's exits equal separate forwards at k = 1..K."""
    model, x = perturb_conditioning(make(conditioning=True, conditioning_budget=False)), tokens()
    with torch.no_grad():
        exits = model(x, loops=3, every_loop=True)
        assert exits.shape == (3, *x.shape, DEBUG.vocab_size)
        for k in (1, 2, 3):
            torch.testing.assert_close(exits[k - 1], model(x, loops=k), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="every_loop needs"):
        make(conditioning=True)(x, loops=2, every_loop=True)


def test_budget_embedding_changes_loop_one_with_the_budget():
    budget = perturb_conditioning(make(conditioning=True))
    loop_only = perturb_conditioning(make(conditioning=True, conditioning_budget=False))
    with torch.no_grad():
        assert not torch.equal(budget.recurrent.conditioning(1, 1)[0][0], budget.recurrent.conditioning(1, 2)[0][0])
        assert torch.equal(loop_only.recurrent.conditioning(1, 1)[0][0], loop_only.recurrent.conditioning(1, 3)[0][0])


def plain_and_conditioned(**cond_options) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An unconditioned model and a conditioned one (non-zero heads) sharing every other weight."""
    plain = make(conditioning=False)
    conditioned = perturb_conditioning(make(conditioning=True, **cond_options))
    copy_shared_weights(plain, conditioned)
    return plain, conditioned


def test_unconditioned_first_loop_is_exactly_the_shared_block():
    x = tokens()
    plain, first_free = plain_and_conditioned(conditioning_first_loop=False)
    with torch.no_grad():
        assert torch.equal(plain(x, loops=1), first_free(x, loops=1))
        assert not torch.allclose(plain(x, loops=2), first_free(x, loops=2))


def test_first_loop_only_conditioning_leaves_the_later_loops_unconditioned():
    x = tokens()
    plain, first_only = plain_and_conditioned(conditioning_later_loops=False)
    with torch.no_grad():
        assert first_only.recurrent.conditioning(2, 3) == [None] * len(first_only.recurrent.layers)
        assert all(film is not None for film in first_only.recurrent.conditioning(1, 3))
        assert not torch.allclose(plain(x, loops=1), first_only(x, loops=1))


def test_conditioning_with_no_loop_conditioned_is_refused():
    from elr.config import load_config
    from elr.errors import ConfigError

    with pytest.raises(ConfigError, match="nothing is conditioned"):
        load_config(None, ["--elr.conditioning_first_loop", "false", "--elr.conditioning_later_loops", "false"])
    with pytest.raises(ConfigError, match="conditioning_exit: needs elr.conditioning = true"):
        load_config(None, ["--elr.conditioning", "false", "--elr.conditioning_exit", "true"])


def test_exit_only_conditioning_leaves_every_loop_as_the_shared_block():
    """FiLM on the output block alone: the loops are the unconditioned block's (its states at every
    k are the plain model's), and only the output block sees the budget."""
    x = tokens()
    plain = make(conditioning=False)
    exit_only = perturb_conditioning(
        make(conditioning=True, conditioning_first_loop=False, conditioning_later_loops=False, conditioning_exit=True)
    )
    copy_shared_weights(plain, exit_only)
    c = exit_only.recurrent.conditioning
    assert not c.heads and c.loop_embed is None and len(c.exit_heads) == DEBUG.partition[2]
    assert exit_only.recurrent.prefix_consistent
    with torch.no_grad():
        for k in (1, 2, 3):
            assert torch.equal(
                plain.recurrent(plain.tok_embeddings(x), plain.rope[:, : x.shape[1]], k)[0],
                exit_only.recurrent(exit_only.tok_embeddings(x), exit_only.rope[:, : x.shape[1]], k)[0],
            )
        assert not torch.allclose(plain(x, loops=2), exit_only(x, loops=2))
        # zero exit heads (the initial model) are invisible
        for head in c.exit_heads:
            head.weight.zero_()
            head.bias.zero_()
        assert torch.equal(plain(x, loops=2), exit_only(x, loops=2))


def test_exit_conditioning_gives_every_exit_its_own_budget():
    """every_loop stacks the exits of loops 1..k; each exit's rows get the FiLM of its own budget, so
    they equal separate forwards at k = 1..K."""
    model = perturb_conditioning(
        make(conditioning=True, conditioning_first_loop=False, conditioning_later_loops=False, conditioning_exit=True)
    )
    x = tokens()
    with torch.no_grad():
        exits = model(x, loops=3, every_loop=True)
        for k in (1, 2, 3):
            torch.testing.assert_close(exits[k - 1], model(x, loops=k), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(exits[0], exits[2])


def test_conditioning_without_gate_has_scale_and_shift_only():
    model, plain = make(conditioning=True, conditioning_gate=False), make(conditioning=False)
    copy_shared_weights(plain, model)
    assert model.recurrent.conditioning.heads[0].out_features == 2 * DEBUG.dim
    x = tokens()
    with torch.no_grad():
        assert torch.equal(model(x, loops=2), plain(x, loops=2))  # zero heads: invisible
        perturb_conditioning(model)
        assert all(len(film) == 2 for film in model.recurrent.conditioning(2, 3))


def test_loss_every_loop_is_the_mean_of_the_exits_losses():
    from elr.train.loss import model_loss, summed_loss

    model, x = perturb_conditioning(make(conditioning=True, conditioning_budget=False)), tokens()
    labels = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        expected = sum(summed_loss(model(x, loops=k), labels) for k in (1, 2, 3)) / 3
        for chunk in (0, 16):
            got = model_loss(model, x, labels, 3, chunk, tensor_parallel=False, every_loop=True)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_silu_conditioning_is_not_additive_in_loop_and_budget():
    """A head fed W(E_loop[i] + E_budget[k]) is additive: film(i,k) - film(i,k') is the same for every i.
    Through a SiLU it is not, so it can single out a pair such as the last loop of k."""
    for silu, additive in ((False, True), (True, False)):
        cond = perturb_conditioning(make(conditioning=True, conditioning_silu=silu)).recurrent.conditioning
        with torch.no_grad():
            cond.loop_embed.weight.normal_()
            cond.budget_embed.weight.normal_()
            shift = [cond(i, 3)[0][0] - cond(i, 2)[0][0] for i in (1, 2)]
        assert torch.allclose(shift[0], shift[1], atol=1e-5) == additive
