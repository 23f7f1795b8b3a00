"""`elr.identity_loops`: every loop past the first starts as the identity, so a model grown from a one-loop
phase computes at every k what it computed at k = 1 (elr/models/recurrence.py, LoopGates and the
conditioning offsets), and the gates then learn like any parameter."""

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import looped_model as make
from trainer_utils import token_batch as tokens

from elr.config import ELR
from elr.train.optimizer import param_groups

# koi4b.toml's recurrence: FiLM from the budget on the output block only, the state norm, the learned step
RECIPE = dict(
    conditioning=True,
    conditioning_first_loop=False,
    conditioning_later_loops=False,
    conditioning_exit=True,
    state_norm=True,
)


@torch.no_grad()
def train_one_loop_path(model, seed=2):
    """What a one-loop phase can change: every parameter except the gates and the offset rows of the
    embeddings (loops and budgets past the first never run at k = 1), moved far from its init."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen) * 0.3
        if name.startswith("recurrent.loop_gates"):
            continue
        if name.endswith(("loop_embed.weight", "budget_embed.weight")):
            p[0] += noise[0]
        else:
            p += noise


@pytest.mark.parametrize("options", [RECIPE, dict(conditioning=True)], ids=["koi4b_recipe", "every_loop_conditioned"])
def test_every_k_computes_the_one_loop_model_at_init_and_after_a_one_loop_phase(options):
    model, x = make(identity_loops=True, **options), tokens()
    with torch.no_grad():
        for stage in ("init", "after a one-loop phase"):
            one = model(x, loops=1)
            for k in (2, 3):
                assert torch.equal(model(x, loops=k), one), (stage, k)
            train_one_loop_path(model)
    plain = make(**options)  # without the option a one-loop phase leaves the later loops untrained
    with torch.no_grad():
        train_one_loop_path(plain)
        assert not torch.allclose(plain(x, loops=2), plain(x, loops=1))


def test_gates_and_offsets_follow_their_formulas():
    """s_i = s_{i-1} + γ_i (u_i − s_{i-1}) for i >= 2, against the loop written out (update replace, the state
    norm); loop and budget embeddings of index j >= 2 are row 1 + their own row."""
    model, x = make(identity_loops=True, update="replace", conditioning=False, state_norm=True), tokens()
    torch.nn.init.normal_(model.recurrent.loop_gates.weight, std=0.5)
    block, rope = model.recurrent, model.rope[:, : x.shape[1]]
    with torch.no_grad():
        h = model.tok_embeddings(x)
        for layer in model.input_layers:
            h = layer(h, rope)
        s = h
        for i in range(1, 4):
            r = block.state_norm(s) if i > 1 else s
            for layer in block.layers:
                r = layer(r, rope)
            s = r if i == 1 else s + block.loop_gates.weight[i - 2] * (r - s)
        for layer in model.output_layers:
            s = layer(s, rope)
        torch.testing.assert_close(model(x, loops=3), model.output(model.norm(s)))
    conditioned = make(identity_loops=True, **RECIPE).recurrent.conditioning
    E = conditioned.budget_embed.weight
    torch.nn.init.normal_(E)
    budgets = torch.tensor([1, 2, 3])
    torch.testing.assert_close(
        conditioned._row(conditioned.budget_embed, budgets), torch.stack([E[0], E[0] + E[1], E[0] + E[2]])
    )
    assert torch.equal(conditioned._row(conditioned.budget_embed, 3), E[0] + E[2])


def test_gates_learn_from_the_later_loops_only_in_their_own_optimizer_group():
    model, x = make(identity_loops=True, **RECIPE), tokens()
    gates = model.recurrent.loop_gates.weight
    assert model.parameter_roles()["recurrent.loop_gates.weight"] == "loop_gate"
    F.cross_entropy(model(x, loops=1).flatten(0, 1), x.flatten()).backward()
    assert gates.grad is None or not gates.grad.any()  # k = 1 runs no gate
    F.cross_entropy(model(x, loops=3).flatten(0, 1), x.flatten()).backward()
    assert gates.grad[0].abs().sum() > 0 and gates.grad[1].abs().sum() > 0
    torch.nn.init.normal_(gates)
    model.record_loop_statistics(True)
    with torch.no_grad():
        model(x, loops=3)
    stats = model.loop_statistics()
    assert "loop_gate_mean" not in stats[0] and [s["loop_gate_mean"].item() for s in stats[1:]] == pytest.approx(
        gates.mean(1).tolist()
    )
    group = next(
        g for g in param_groups(model, 0.1, 1e-3, ELR(loop_gate_lr_scale=20.0)) if any(p is gates for p in g["params"])
    )
    assert len(group["params"]) == 1 and group["lr"] == pytest.approx(2e-2) and group["weight_decay"] == 0.0


def test_budgets_per_row_with_identity_loops_equal_each_row_alone():
    model, x = make(identity_loops=True, **RECIPE), tokens(B=3)
    torch.nn.init.normal_(model.recurrent.loop_gates.weight, std=0.5)
    torch.nn.init.normal_(model.recurrent.conditioning.budget_embed.weight, std=0.5)
    for head in model.recurrent.conditioning.exit_heads:
        torch.nn.init.normal_(head.weight, std=0.1)
    budgets = torch.tensor([1, 3, 2])
    with torch.no_grad():
        mixed = model(x, loops=budgets)
        for row, k in enumerate(budgets.tolist()):
            torch.testing.assert_close(mixed[row], model(x[row : row + 1], loops=k)[0])


def test_a_fully_faded_model_is_the_plain_recurrence_and_the_fade_follows_the_step():
    """fade = 1 with learned gates at zero: every loop fully open, the model without identity_loops (same
    weights) to the bit; the schedule: 0 at the first mixed-depth update, 1 after loop_fade_steps more."""
    from elr.config import load_config
    from elr.train.loop_sampler import DepthSchedule

    gated, plain, x = make(identity_loops=True, **RECIPE), make(**RECIPE), tokens()
    train_one_loop_path(plain)
    keys = set(gated.state_dict())
    gated.load_state_dict({k: v for k, v in plain.state_dict().items() if k in keys}, strict=False)
    E = plain.recurrent.conditioning.budget_embed.weight.detach()
    gated.recurrent.conditioning.budget_embed.weight.data[1:] = E[1:] - E[0]  # offsets that give plain's rows
    gated.set_loop_fade(1.0)
    with torch.no_grad():
        for k in (1, 2, 3):
            torch.testing.assert_close(gated(x, loops=k), plain(x, loops=k), rtol=0, atol=1e-5)  # E0 + (Ek - E0)
    cfg = load_config(
        None,
        [
            "--elr.switch_at",
            "0.5",
            "--training.steps",
            "10",
            "--checkpoint.enable",
            "true",
            "--elr.identity_loops",
            "true",
            "--elr.loop_fade_steps",
            "4",
        ],
    )
    depths = DepthSchedule(cfg, 1, 2)
    assert [depths.loop_fade(s, 4) for s in range(5, 11)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]
