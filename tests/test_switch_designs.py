"""The late switch's designs as options (issue 57): each one's formula against the loop written out, what it leaves
unchanged at the switch, and the optimizer and schedule parts (elr/models/recurrence.py's LoopGates and LoopDeltas,
elr/train/optimizer.py's SwitchLR, elr/train/switch_aids.py)."""

import pytest
import torch
import torch.nn.functional as F
from test_identity_loops import RECIPE, train_one_loop_path
from trainer_utils import looped_model as make
from trainer_utils import token_batch as tokens

from elr.config import ELR, LRScheduler, load_config
from elr.errors import ConfigError
from elr.train.optimizer import SwitchLR, build_lr_scheduler, param_groups
from elr.train.switch_aids import SwitchObjectives, summed_kl


def written_out(model, x, gate, delta=None):
    """The model at k = 3 with the loop written out (update replace, no conditioning, the state norm): loop i >= 2
    moves the state by gate(i) times what its layers propose; delta(i, l, h) is added to sublayer l's output."""
    block, rope = model.recurrent, model.rope[:, : x.shape[1]]
    h = model.tok_embeddings(x)
    for layer in model.input_layers:
        h = layer(h, rope)
    s = h
    for i in range(1, 4):
        r = block.state_norm(s) if i > 1 else s
        for j, layer in enumerate(block.layers):
            n = layer.norm(r)
            y = layer.sublayer(n, rope) if "rope" in layer.inputs else layer.sublayer(n)
            if delta is not None and i > 1:
                y = y + delta(i, j, n)
            r = r + y
        s = r if i == 1 else s + gate(i) * (r - s)
    for layer in model.output_layers:
        s = layer(s, rope)
    return model.output(model.norm(s))


PLAIN = dict(identity_loops=True, update="replace", conditioning=False, state_norm=True)


def test_scaled_gates_are_the_fade_times_the_learned_part_never_below_the_floor():
    model, x = make(**PLAIN, loop_gate="scaled", loop_gate_floor=0.5), tokens()
    gates = model.recurrent.loop_gates
    with torch.no_grad():
        gates.weight[0] = torch.linspace(-2, 1, gates.weight.shape[1])  # some below the floor (1 + w < 0.5)
        gates.weight[1] = 0.3
    model.set_loop_fade(0.4)
    with torch.no_grad():
        want = written_out(model, x, lambda i: 0.4 * torch.clamp(1 + gates.weight[i - 2], min=0.5))
        torch.testing.assert_close(model(x, loops=3), want)
        assert gates.gate(2).min().item() == pytest.approx(0.2)  # floor x fade: the optimizer cannot shut loop 2
    # the learned part below the floor gets no gradient; above it, it does
    F.cross_entropy(model(x, loops=3).flatten(0, 1), x.flatten()).backward()
    below = 1 + gates.weight[0].detach() < 0.5
    assert not gates.weight.grad[0][below].any() and gates.weight.grad[0][~below].abs().sum() > 0
    # the added form: the learned part cancels the fade, w = -fade shuts the loop
    added = make(**PLAIN)
    added.set_loop_fade(0.4)
    with torch.no_grad():
        added.recurrent.loop_gates.weight.fill_(-0.4)
        assert not added.recurrent.loop_gates.gate(2).any()


@pytest.mark.parametrize("form", ["added", "scaled"])
def test_both_gate_forms_keep_every_k_the_one_loop_model_before_the_fade(form):
    model, x = make(identity_loops=True, loop_gate=form, loop_gate_floor=0.5 * (form == "scaled"), **RECIPE), tokens()
    train_one_loop_path(model)
    with torch.no_grad():
        one = model(x, loops=1)
        assert all(torch.equal(model(x, loops=k), one) for k in (2, 3))
        model.set_loop_fade(0.5)
        assert not torch.allclose(model(x, loops=3), one)


def test_loop_deltas_follow_their_formula_and_start_at_zero():
    model, x = make(**PLAIN, loop_delta_rank=3), tokens()
    deltas = model.recurrent.loop_deltas
    assert deltas.down.shape == (2, 2, 3, model.args.dim) and not deltas.up.any()  # zero at init
    with torch.no_grad():
        model.recurrent.loop_gates.weight.fill_(0.7)
        start = model(x, loops=3)
        torch.testing.assert_close(start, written_out(model, x, lambda i: 0.7))  # B = 0: the shared block's loops
        torch.nn.init.normal_(deltas.up, std=0.3)
        want = written_out(model, x, lambda i: 0.7, lambda i, j, n: n @ deltas.down[i - 2, j].T @ deltas.up[i - 2, j].T)
        torch.testing.assert_close(model(x, loops=3), want)
        assert not torch.allclose(model(x, loops=3), start)
        one = model(x, loops=1)
        deltas.up.mul_(5)
        assert torch.equal(model(x, loops=1), one)  # k = 1 never runs a delta


def test_loop_deltas_take_the_later_loops_gradients_in_their_own_group():
    model, x = make(loop_delta_rank=2, **RECIPE), tokens()
    deltas = model.recurrent.loop_deltas
    roles = model.parameter_roles()
    assert roles["recurrent.loop_deltas.down"] == roles["recurrent.loop_deltas.up"] == "loop_delta"
    F.cross_entropy(model(x, loops=1).flatten(0, 1), x.flatten()).backward()
    assert deltas.up.grad is None or not deltas.up.grad.any()
    F.cross_entropy(model(x, loops=3).flatten(0, 1), x.flatten()).backward()
    assert deltas.up.grad[0].abs().sum() > 0 and deltas.up.grad[1].abs().sum() > 0  # loops 2 and 3
    group = next(g for g in param_groups(model, 0.1, 1e-3, ELR()) if any(p is deltas.up for p in g["params"]))
    assert group["loop_specific"] and group["weight_decay"] == 0.0 and group["lr"] == 1e-3
    assert model.num_flops_per_token(16, 3) - make(**RECIPE).num_flops_per_token(16, 3) == 12 * 2 * 64 * 2 * 2


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_loop_deltas_under_activation_checkpointing_give_the_same_loss_and_gradients(mode):
    """A checkpointed layer hands the later loops' delta into its region (recomputed in backward, like the rest)."""
    from elr.parallel.activation_checkpoint import apply_activation_checkpointing

    x = tokens()
    plain, wrapped = make(loop_delta_rank=2, **RECIPE), make(loop_delta_rank=2, **RECIPE)
    with torch.no_grad():
        for p in [*plain.recurrent.loop_deltas.parameters(), *wrapped.recurrent.loop_deltas.parameters()]:
            torch.manual_seed(p.numel())
            p.copy_(torch.randn_like(p) * 0.1)  # deltas away from zero, so they change the output
    assert apply_activation_checkpointing(wrapped, mode) > 0
    losses = [F.cross_entropy(m(x, loops=3).flatten(0, 1), x.flatten()) for m in (plain, wrapped)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    grads = dict(plain.named_parameters())
    for name, p in wrapped.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_switch_lr_windows_scale_each_group_as_asked():
    """Re-warm: every group from 1/(n+1) back to its schedule over n updates after the switch; healing: the groups
    k = 1 uses at lr x scale, the loop-specific ones at their schedule; nothing before the switch."""
    model = make(identity_loops=True, loop_delta_rank=2, **RECIPE)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 1.0, ELR()))
    cfg = LRScheduler(warmup_steps=0, decay_type="wsd", decay_fraction=0.1)
    sched = build_lr_scheduler(opt, cfg, 40, SwitchLR(step=10, warmup_steps=4, heal_steps=6, heal_lr_scale=0.1))
    lrs = []
    for _ in range(20):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    specific = [g.get("loop_specific", False) for g in opt.param_groups]
    assert specific.count(True) == 2  # the gates, the deltas
    for step, row in enumerate(lrs):
        rewarm = (step - 9) / 5 if 10 <= step < 14 else 1.0
        heal = 0.1 if 10 <= step < 16 else 1.0
        want = [rewarm * (1.0 if s else heal) for s in specific]
        assert row == pytest.approx(want), step


def test_a_healing_window_freezes_what_k1_computes():
    """In the window every parameter k = 1 uses stands still (lr x 0, AdamW's decay scaled alike); the gates and
    deltas move, so k = 1 after the window's updates is the switch's to the bit."""
    model, x = make(identity_loops=True, loop_delta_rank=2, **RECIPE), tokens()
    model.set_loop_fade(1.0)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 1e-2, ELR()))
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=0), 20, SwitchLR(step=1, heal_steps=5, heal_lr_scale=0.0))
    opt.step(), sched.step()  # update 1: before the switch
    with torch.no_grad():
        one = model(x, loops=1)
    gates = model.recurrent.loop_gates.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x, loops=3).flatten(0, 1), x.flatten()).backward()
        opt.step(), sched.step()
    with torch.no_grad():
        assert torch.equal(model(x, loops=1), one)
    assert not torch.equal(model.recurrent.loop_gates.weight, gates) and model.recurrent.loop_deltas.up.any()


def test_the_anchor_weight_decays_over_its_window_and_its_kl_is_zero_at_the_switch():
    cfg = load_config(
        None,
        ["--elr.switch_at", "0.5", "--training.steps", "20", "--checkpoint.enable", "true", "--elr.k1_anchor", "2"],
    )
    objectives = SwitchObjectives(cfg)
    assert [objectives.anchor_weight(s) for s in (10, 11, 12, 20)] == pytest.approx([0, 2, 1.8, 0.2])
    cfg.elr.k1_anchor_steps = 4
    objectives = SwitchObjectives(cfg)
    assert [objectives.anchor_weight(s) for s in (11, 13, 15, 16)] == pytest.approx([2, 1, 0, 0])
    model, x = make(identity_loops=True, **RECIPE), tokens()
    objectives.build_teacher(model.args, torch.device("cpu"))
    objectives.copy_model(model.state_dict())
    ce, extra = objectives.loss(model, x, x, 1, step=11)
    assert extra.item() == 0 and ce.item() == pytest.approx(
        F.cross_entropy(model(x).flatten(0, 1), x.flatten(), reduction="sum").item()
    )
    extra.backward()  # no pull at the switch itself (to rounding: softmax against exp of log-softmax)
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-6
    with torch.no_grad():
        model.output.weight.add_(0.1)
    _, extra = objectives.loss(model, x, x, 1, step=13)
    assert extra.item() > 0 and not any(p.requires_grad for p in objectives.teacher.parameters())


def test_kl_is_the_textbook_one_over_scored_tokens():
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 5, 7, generator=gen), torch.randn(2, 5, 7, generator=gen)
    labels = torch.ones(2, 5, dtype=torch.long)
    labels[1, 3] = -100
    kl = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(summed_kl(t, s, labels), (kl * (labels != -100)).sum())


def test_the_consistency_term_is_zero_while_the_loops_are_the_identity_and_reads_every_exit():
    cfg = load_config(None, ["--elr.loop_consistency", "0.5"])
    objectives = SwitchObjectives(cfg)
    model, x = make(identity_loops=True, **{**RECIPE, "conditioning_first_loop": True}), tokens()  # koi4b's
    ce, extra = objectives.loss(model, x, x, 3, step=1)
    assert extra.item() == 0
    torch.testing.assert_close(ce, F.cross_entropy(model(x, loops=3).flatten(0, 1), x.flatten(), reduction="sum"))
    model.set_loop_fade(1.0)
    _, extra = objectives.loss(model, x, x, 3, step=1)
    exits = model(x, loops=3, loop_exits=True)
    want = 0.5 * (summed_kl(exits[2], exits[0], x) + summed_kl(exits[2], exits[1], x)) / 2
    torch.testing.assert_close(extra, want)
    with pytest.raises(ValueError, match="every_loop needs"):  # budget k's loop 1 is not budget 1's: no every_loop
        model(x, loops=3, every_loop=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--elr.loop_gate", "scaled"], "^elr.loop_gate: scaled needs elr.identity_loops"),
        (["--elr.identity_loops", "true", "--elr.loop_gate", "scaled"], "^elr.loop_gate: scaled needs elr.loop_fade"),
        (["--elr.loop_gate_floor", "0.3"], "^elr.loop_gate_floor: needs elr.loop_gate = scaled"),
        (["--elr.loop_gate_floor", "1.5"], "^elr.loop_gate_floor: must lie in"),
        (["--elr.loop_delta_rank", "-1"], "^elr.loop_delta_rank: must be >= 0"),
        (["--elr.switch_heal_steps", "5"], "^elr.switch_heal_steps: needs a late switch"),
        (["--elr.k1_anchor", "1"], "^elr.k1_anchor: needs a late switch"),
        (["--elr.switch_warmup_steps", "5"], "^elr.switch_warmup_steps: needs a late switch"),
        (["--elr.k1_anchor_steps", "5"], "^elr.k1_anchor_steps: needs elr.k1_anchor"),
        (["--elr.switch_heal_lr_scale", "2"], "^elr.switch_heal_lr_scale: must lie in"),
        (["--elr.loop_consistency", "-1"], "^elr.loop_consistency: must be >= 0"),
        (
            ["--elr.loop_consistency", "1", "--elr.conditioning_budget", "false", "--elr.loss_every_loop", "true"],
            "^elr.loop_consistency: and elr.loss_every_loop",
        ),
        (
            ["--elr.loop_consistency", "1", "--training.loss_chunk_tokens", "64"],
            "^training.loss_chunk_tokens: must be 0",
        ),
    ],
)
def test_a_design_without_what_it_acts_on_is_refused_naming_its_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_healing_window_needs_loop_parameters_and_room_after_the_switch():
    switch = ["--elr.switch_at", "0.5", "--training.steps", "20", "--checkpoint.enable", "true"]
    with pytest.raises(ConfigError, match="^elr.switch_heal_steps: needs parameters of the later loops"):
        load_config(None, [*switch, "--elr.switch_heal_steps", "5"])
    with pytest.raises(ConfigError, match="^elr.switch_heal_steps: must end by the last step"):
        load_config(None, [*switch, "--elr.switch_heal_steps", "11", "--elr.loop_delta_rank", "2"])
    load_config(None, [*switch, "--elr.switch_heal_steps", "10", "--elr.loop_delta_rank", "2"])
    with pytest.raises(ConfigError, match="^elr.k1_anchor: runs under data parallelism only"):
        load_config(None, [*switch, "--elr.k1_anchor", "1", "--parallelism.context_parallel_degree", "2"])


@pytest.mark.parametrize("kv_mode, preserved", [("per_loop", True), ("last_loop", False)])
def test_function_preservation_holds_for_the_full_forward_and_the_per_loop_cache_not_the_last_loop_cache(
    kv_mode, preserved
):
    """At the switch (identity loops after a one-loop phase) a decoded token at k = 2 computes what k = 1 computes
    through a per-loop cache; through the last-loop cache its first loop attends to keys and values the previous
    tokens' last loop made (from s_1, not s_0), so it differs (docs/recurrence.md)."""
    from elr.infer.cache import InferenceCache

    model, x = make(identity_loops=True, **{**RECIPE, "conditioning_first_loop": True}), tokens(B=1)
    train_one_loop_path(model)
    model.eval()
    with torch.no_grad():
        full = model(x, loops=1)[:, -1]
        cache = InferenceCache(model, 1, x.shape[1], 2, kv_mode)
        model(x[:, :-1], 2, cache)
        decoded = model(x[:, -1:], 2, cache)[:, -1]
    assert torch.allclose(decoded, full, atol=1e-5) == preserved


def test_initial_state_noise_breaks_function_preservation_in_training_forwards_only():
    model, x = make(identity_loops=True, initial_state_noise=0.5, **RECIPE), tokens()
    train_one_loop_path(model)
    with torch.no_grad():
        one = model(x, loops=1)
        assert not torch.allclose(model(x, loops=2), one)  # s_0 = h_in + sigma eps at k >= 2 in training
        model.eval()
        assert torch.equal(model(x, loops=2), one)
