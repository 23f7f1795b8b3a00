"""The looped-model training aids (issue 35), each a recurrence option: what each does to the model, and
that k = 1 is the plain stack where the option says so (elr/models/recurrence.py, elr/models/model.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from trainer_utils import looped_model as make
from trainer_utils import token_batch as tokens

from elr.models.layers import Layer

LAYER_INIT = Layer.init_weights


def same_weights(src, dst):
    """dst with src's parameters where both have them (dst's own extras keep their init)."""
    keys = set(dst.state_dict())
    dst.load_state_dict({k: v for k, v in src.state_dict().items() if k in keys}, strict=False)
    return dst


def recurrent_states(model, x, loops, detach_at=None, adapter=False, norm=False):
    """The block's loop written out from the model's own layers (`replace` update, no conditioning)."""
    rope = model.rope[:, : x.shape[1]]
    h = model.tok_embeddings(x)
    for layer in model.input_layers:
        h = layer(h, rope)
    s = h
    for i in range(1, loops + 1):
        if i == detach_at:
            s = s.detach()
        if norm and i > 1:
            s = model.recurrent.state_norm(s)
        r = s + model.recurrent.input_adapter(h) if adapter else s
        for layer in model.recurrent.layers:
            r = layer(r, rope)
        s = r
    for layer in model.output_layers:
        s = layer(s, rope)
    return model.output(model.norm(s))


def test_adapted_input_is_the_plain_stack_at_init_and_learns_at_every_loop():
    x = tokens()
    plain, adapted = make(), make(recurrent_input="state_plus_adapted_input")
    same_weights(plain, adapted)
    for k in (1, 2, 3):
        assert torch.equal(plain(x, loops=k), adapted(x, loops=k)), k
    F.cross_entropy(adapted(x, loops=1).flatten(0, 1), x.flatten()).backward()
    assert adapted.recurrent.input_adapter.weight.grad.abs().sum() > 0  # trains from k = 1 on
    assert adapted.parameter_roles()["recurrent.input_adapter.weight"] == "matrix"


def test_adapted_input_follows_its_formula_at_every_loop_the_first_included():
    model = make(recurrent_input="state_plus_adapted_input", update="replace")
    torch.nn.init.normal_(model.recurrent.input_adapter.weight, std=0.05)
    x = tokens()
    with torch.no_grad():
        for k in (1, 2, 3):
            torch.testing.assert_close(model(x, loops=k), recurrent_states(model, x, k, adapter=True))
        assert not torch.allclose(model(x, loops=1), same_weights(model, make(update="replace"))(x, loops=1))


def test_state_norm_leaves_one_loop_alone_and_norms_between_loops():
    x = tokens()
    plain, normed = make(update="replace"), make(update="replace", state_norm=True)
    same_weights(plain, normed)
    assert torch.equal(plain(x, loops=1), normed(x, loops=1))
    torch.nn.init.normal_(normed.recurrent.state_norm.weight, mean=1.0, std=0.1)
    assert torch.equal(plain(x, loops=1), normed(x, loops=1))  # no norm runs at k = 1, whatever its weight
    with torch.no_grad():
        for k in (2, 3):
            assert not torch.allclose(plain(x, loops=k), normed(x, loops=k)), k
            torch.testing.assert_close(normed(x, loops=k), recurrent_states(normed, x, k, norm=True))
    assert normed.parameter_roles()["recurrent.state_norm.weight"] == "norm"


def _grads(model, x, loops):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x, loops=loops).flatten(0, 1), x.flatten()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("n", [1, 2])
def test_truncated_backprop_cuts_the_early_loops_gradients(n):
    x, k = tokens(), 3
    full, truncated = make(update="replace"), make(update="replace", backprop_loops=n)
    same_weights(full, truncated)
    with torch.no_grad():
        assert torch.equal(full(x, loops=k), truncated(x, loops=k))  # the forward is unchanged
    grads = _grads(truncated, x, k)
    # Only the state carries the input block's work into the loops: with it cut, no gradient reaches it.
    assert all(grads[name] is None for name in grads if name.startswith(("input_layers.", "tok_embeddings.")))
    # The recurrent layers get exactly the gradient of the loop written out with the state detached.
    truncated.zero_grad(set_to_none=True)
    F.cross_entropy(recurrent_states(truncated, x, k, detach_at=k - n + 1).flatten(0, 1), x.flatten()).backward()
    for name, p in truncated.named_parameters():
        if name.startswith("recurrent."):
            torch.testing.assert_close(grads[name], p.grad, msg=name)
    # ... and those differ from the full gradient: the early loops' contribution is gone
    full_grads = _grads(full, x, k)
    assert not torch.allclose(full_grads["recurrent.layers.0.norm.weight"], grads["recurrent.layers.0.norm.weight"])


def test_truncated_backprop_changes_nothing_within_its_window():
    x = tokens()
    full, truncated = make(), make(backprop_loops=2)
    same_weights(full, truncated)
    for k in (1, 2):
        a, b = _grads(full, x, k), _grads(truncated, x, k)
        assert all(torch.equal(a[name], b[name]) for name in a if a[name] is not None), k


@pytest.mark.parametrize("recurrent_input", ["state", "state_plus_input"])
def test_truncated_backprop_flops_count_the_loops_outside_the_window_forward_only(recurrent_input):
    """The model's count against FlopCounterMode's (matmuls and attention, forward + backward)."""
    from test_model import CPU_ATTENTION_FLOPS

    model = make(backprop_loops=1, recurrent_input=recurrent_input)
    B, T = 2, 12
    x = tokens(B, T)
    a = model.args
    recompute = 2 * a.n_heads * a.head_dim * T  # flash attention's backward recomputes the scores
    for loops in (1, 2, 3):
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            F.cross_entropy(model(x, loops=loops).flatten(0, 1), x.flatten()).backward()
        counted = sum(counter.get_flop_counts()["Global"].values()) / (B * T)
        # attention layers with a backward: the input block's (unless cut off) and the last loop's
        with_backward = 1 + (1 if loops == 1 or recurrent_input != "state" else 0)
        assert counted == model.num_flops_per_token(T, loops) + with_backward * recompute, loops
    assert model.num_flops_per_token(T, 3) < make(recurrent_input=recurrent_input).num_flops_per_token(T, 3)


def test_truncated_backprop_keeps_the_reinjected_inputs_gradient():
    x = tokens()
    model = make(recurrent_input="state_plus_input", backprop_loops=1)
    grads = _grads(model, x, 3)
    assert grads["input_layers.0.norm.weight"].abs().sum() > 0


def _init_stds(monkeypatch, **options) -> list[float]:
    seen = []
    monkeypatch.setattr(Layer, "init_weights", lambda self, out_std: (seen.append(out_std), LAYER_INIT(self, out_std)))
    make(**options)
    return seen


def test_depth_scaled_init_counts_the_layers_of_k_loops(monkeypatch):
    assert _init_stds(monkeypatch) == [0.02 / (2 * d) ** 0.5 for d in (1, 2, 3, 4)]
    # 1 input layer, 2 recurrent layers at their 3rd loop (positions 6, 7), the output block after them
    scaled = _init_stds(monkeypatch, depth_scaled_init=True)
    assert scaled == [0.02 / (2 * d) ** 0.5 for d in (1, 6, 7, 8)]
    x = tokens()
    plain = make(max_loops=1, update="replace", conditioning=False)
    one_loop = make(max_loops=1, update="replace", conditioning=False, depth_scaled_init=True)
    assert torch.equal(plain(x), one_loop(x))  # K = 1: the same initial weights


def test_initial_state_noise_only_in_training_forwards_of_several_loops():
    x = tokens()
    plain, noisy = make(), make(initial_state_noise=0.5)
    same_weights(plain, noisy)
    for model in (plain, noisy):
        model.eval()
    with torch.no_grad():
        for k in (1, 2, 3):
            assert torch.equal(plain(x, loops=k), noisy(x, loops=k)), k  # evaluation: s_0 = h_in
        plain.train(), noisy.train()
        assert torch.equal(plain(x, loops=1), noisy(x, loops=1))  # k = 1 trains the plain stack
        torch.manual_seed(5)
        first = noisy(x, loops=2)
        assert not torch.allclose(first, plain(x, loops=2))
        torch.manual_seed(5)
        assert torch.equal(first, noisy(x, loops=2))  # the noise follows the CPU generator, which checkpoints save
    torch.manual_seed(5)
    before = torch.get_rng_state()
    noisy(x, loops=1)
    assert not torch.equal(before, torch.get_rng_state())  # drawn at k = 1 too: every rank's generator advances alike


def test_one_process_gives_a_parameter_its_update_left_idle_zero_gradients_as_fsdp_does():
    """The state norm runs from loop 2 on: after a k = 1 update it still has a gradient (zeros) and AdamW
    state, as under FSDP (elr/parallel/gradients.py), so a checkpoint holds optimizer state for it."""
    from elr.parallel.gradients import fill_unused

    model, x = make(state_norm=True), tokens()
    F.cross_entropy(model(x, loops=1).flatten(0, 1), x.flatten()).backward()
    assert model.recurrent.state_norm.weight.grad is None
    fill_unused(model)
    assert torch.equal(model.recurrent.state_norm.weight.grad, torch.zeros_like(model.recurrent.state_norm.weight))
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    assert "exp_avg" in optimizer.state[model.recurrent.state_norm.weight]
