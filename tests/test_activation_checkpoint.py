"""Activation checkpointing changes memory, never the numbers: gradients and MoE load counts with
each AC mode equal those without AC, at every loop count, with and without MoE route replay."""

import copy

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import model_args

from elr.models import build_model, flavors
from elr.parallel.activation_checkpoint import CheckpointedLayer, apply_activation_checkpointing

DEBUG = model_args(flavors["debug"], max_loops=3, update="adaptive_delta")
MODES = [("full", "op"), ("selective", "op"), ("selective", "2")]  # (mode, selective_ac_option)


def make(route_replay=False):
    torch.manual_seed(0)
    model = build_model(model_args(DEBUG, max_seq_len=16, conditioning=True, moe_route_replay=route_replay))
    model.init_weights()
    with torch.no_grad():  # move the zero-initialised ELR heads off their identity values
        for p in model.recurrent.parameters():
            if p.abs().sum() == 0:
                p.normal_(std=0.02)
    return model


def grads_and_counts(model, tokens, loops):
    model.zero_grad()
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()
    loss = F.cross_entropy(model(tokens, loops=loops).flatten(0, 1), tokens.flatten())
    (loss + 0.1 * model.moe_aux_loss()).backward()  # the balance loss's backward recomputes under AC too
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return grads, [m.tokens_per_expert.clone() for m in model.moe_layers()]


@pytest.mark.parametrize("mode,option,route_replay", [*[(m, o, False) for m, o in MODES], ("full", "op", True)])
def test_gradients_and_moe_counts_with_ac_equal_without(mode, option, route_replay):
    reference = make(route_replay)
    tokens = torch.randint(0, DEBUG.vocab_size, (1, 16))
    expected = {k: grads_and_counts(reference, tokens, k) for k in (1, 2, 3)}
    model = copy.deepcopy(reference)
    wrapped = apply_activation_checkpointing(model, mode, option)
    assert wrapped == (DEBUG.n_layers // 2 if option == "2" else DEBUG.n_layers)
    assert model.state_dict().keys() == reference.state_dict().keys()
    for k in (1, 2, 3):
        grads, counts = grads_and_counts(model, tokens, k)
        want_grads, want_counts = expected[k]
        assert grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(
                grads[name], want_grads[name], rtol=0, atol=1e-6, msg=f"{mode} {option} k={k} {name}"
            )
        for got, want in zip(counts, want_counts):
            assert torch.equal(got, want), (mode, option, k)  # recomputation does not count twice


def test_every_second_layer_is_wrapped_across_the_whole_stack():
    model = make()
    apply_activation_checkpointing(model, "selective", "2")
    layers = list(model.layers())
    assert [isinstance(layer, CheckpointedLayer) for layer in layers] == [i % 2 == 1 for i in range(len(layers))]


@pytest.mark.slow
@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op")])
def test_compiled_checkpointed_layers_match_eager_and_count_once(mode, option):
    """Dynamo and AOTAutograd, where checkpoint regions and the op policy are traced; the "aot_eager"
    backend skips inductor's code generation, which test_compile_float8 covers, to keep this fast."""
    reference = make()
    tokens = torch.randint(0, DEBUG.vocab_size, (1, 16))
    want_grads, want_counts = grads_and_counts(reference, tokens, 2)
    model = copy.deepcopy(reference)
    apply_activation_checkpointing(model, mode, option)
    for layer in model.layers():
        layer.compile(backend="aot_eager")
    grads, counts = grads_and_counts(model, tokens, 2)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=f"{mode} {name}")
    assert all(torch.equal(got, want) for got, want in zip(counts, want_counts)), mode
