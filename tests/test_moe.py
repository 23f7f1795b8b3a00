"""The mixture of experts: a token-by-token reference, the aux-loss-free bias, route replay and the
sequence-level balance loss."""

import dataclasses

import pytest
import torch
from test_model import DEBUG, make, tokens

import elr.models.ffn as ffn_module
from elr.models.ffn import MoE, relu2, sequence_balance_loss
from elr.train.optimizer import update_expert_biases


def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sigmoid scores, top-k by biased score, normalised weights, plus shared."""
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        scores = torch.sigmoid(moe.router(token))
        chosen = torch.topk(scores + moe.expert_bias, moe.top_k).indices
        w = scores[chosen] / scores[chosen].sum() * moe.routed_scale
        y = sum(w[j] * (relu2(token @ moe.w1[e].T) @ moe.w2[e].T) for j, e in enumerate(chosen.tolist()))
        out.append(y + moe.shared(token))
    return torch.stack(out).view_as(x)


def test_moe_matches_token_by_token_reference():
    moe = MoE(dataclasses.replace(DEBUG, moe_routed_scale=2.5))
    torch.manual_seed(0)
    moe.init_weights(0.02)
    moe.expert_bias.copy_(torch.randn(DEBUG.moe_experts) * 0.1)  # the bias steers the selection
    x = torch.randn(2, 5, DEBUG.dim)
    torch.testing.assert_close(moe(x), moe_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_expert_bias_moves_towards_balance():
    moe = MoE(DEBUG)
    moe.init_weights(0.02)
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5]))
    stats = update_expert_biases([moe], rate=0.01)
    assert moe.expert_bias[0] < 0 < moe.expert_bias[1]  # overloaded down, idle up
    assert moe.tokens_per_expert.sum() == 0
    assert stats["moe/max_load_over_mean"] == pytest.approx(2.0)


def test_evaluation_does_not_count_expert_load():
    model = make()
    model.eval()
    model(tokens(), loops=2)
    assert all(m.tokens_per_expert.sum() == 0 for m in model.moe_layers())


@pytest.mark.parametrize("replay", [False, True])
def test_route_replay_routes_once_and_counts_loop_one_only(replay):
    model = make(moe_route_replay=replay)
    moe = model.recurrent.layers[1].sublayer
    assert isinstance(moe, MoE)
    router_calls = []
    moe.router.register_forward_hook(lambda *a: router_calls.append(1))
    x = tokens()
    model(x, loops=3)
    assert len(router_calls) == (1 if replay else 3)
    assert moe.tokens_per_expert.sum() == x.numel() * moe.top_k * len(router_calls)


def test_route_replay_is_identity_at_one_loop():
    x = tokens()
    assert torch.equal(make(moe_route_replay=True)(x, loops=1), make(moe_route_replay=False)(x, loops=1))


def test_sequence_balance_loss_closed_form():
    # E=2, top_k=1; sequence 0: both tokens pick expert 0, sequence 1: one each.
    scores = torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.5, 0.5], [0.3, 0.1]])
    indices = torch.tensor([[0], [0], [1], [0]])
    # seq 0: f = 2/(1*2) * [2, 0] = [2, 0], P = [0.7, 0.3] -> 1.4
    # seq 1: f = [1, 1], P = mean([0.5, 0.5], [0.75, 0.25]) = [0.625, 0.375] -> 1.0
    assert sequence_balance_loss(scores, indices, batch=2).item() == pytest.approx((1.4 + 1.0) / 2)


def test_aux_loss_trains_the_router_alone_and_only_in_training():
    moe = MoE(DEBUG)
    torch.manual_seed(0)
    moe.init_weights(0.02)
    moe(torch.randn(2, 6, DEBUG.dim))
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.w1.grad is None and moe.w2.grad is None  # counts carry no gradient, experts none
    moe.eval()
    moe.aux_loss = None
    moe(torch.randn(2, 6, DEBUG.dim))
    assert moe.aux_loss is None


@pytest.mark.parametrize("replay", [False, True])
def test_aux_loss_is_summed_per_routing_call_and_replayed_loops_add_none(replay, monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(sequence_balance_loss(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(ffn_module, "sequence_balance_loss", counted)
    model = make(moe_route_replay=replay)
    for loops in (3, 2):  # the second forward starts from zero again
        calls.clear()
        model(tokens(), loops=loops)
        n_outer = sum(kind == "E" for kind in DEBUG.layer_pattern) - 1  # one E in the recurrent block
        assert len(calls) == n_outer + (1 if replay else loops)
        torch.testing.assert_close(model.moe_aux_loss(), torch.stack(calls).sum())


# torch's counter knows the CUDA attention kernels; teach it the CPU one with torch's own formulas.
