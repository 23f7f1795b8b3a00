"""The RLVR update against hand-computed values: loss/train for each loss type on a two-group batch, the
world-size scaling, one k per group in the sampler's proportions (dynamic sampling keeping them), the clip binding
once `rl.minibatches` splits a batch, RLTT's loop weights, DAPO's overlong punishment, the k3 estimator
averaging to the exact KL, and the non-finite guard deciding on each update's reduced loss."""

import math

import pytest
import torch
from test_rl import RL, sft_model  # noqa: F401  (the module's SFT checkpoint fixture)
from trainer_utils import DEBUG_TOML

from elr.config import load_config
from elr.rl.objective import (
    clipped_surrogate,
    k3_kl,
    loop_weights,
    loss_denominator,
    overlong_penalty,
    token_weights,
)
from elr.rl.rollout import without_signal
from elr.rl.trainer import RLTrainer
from elr.rl.update import Micro, micro_loss


def trainer(tmp_path, sft, *extra) -> RLTrainer:
    cfg = load_config(
        DEBUG_TOML,
        [
            *RL,
            "--training.steps",
            "3",
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.enable",
            "false",
            "--rl.samples_every",
            "0",
            "--checkpoint.initial_load_path",
            str(sft),
            *extra,
        ],
    )
    return RLTrainer(cfg)


def scored_tokens(batch, max_new: int) -> list[int]:
    """Each completion's scored tokens: its new tokens and the end token where it stopped."""
    return [len(c) + (len(c) < max_new) for c in batch.completions]


@pytest.mark.parametrize(
    "loss_type, scale_rewards", [("dapo", "group"), ("grpo", "group"), ("dr_grpo", "none"), ("grpo", "none")]
)
def test_loss_train_by_hand_for_each_loss_type(tmp_path, sft_model, loss_type, scale_rewards):  # noqa: F811
    """Two groups of four, one update: the ratio is 1, so the loss is -sum_i A_i c_i / D with c_i the
    completion's tokens (dapo, dr_grpo) or 1 (grpo, a completion's mean), D the batch's tokens (dapo),
    completions (grpo) or completions x max_new_tokens (dr_grpo); A_i from the group's rewards by hand."""
    t = trainer(tmp_path, sft_model, "--rl.loss_type", loss_type, "--rl.scale_rewards", scale_rewards)
    try:
        batch = t.rollout(1)  # the step's draws depend on (seed, step) alone: train_step samples the same
        loss = t.train_step(1).scalars["loss/train"]
    finally:
        t.close()
    tokens = scored_tokens(batch, 6)
    advantages = []
    for g in range(2):
        rewards = batch.rewards[4 * g : 4 * g + 4]
        mean = sum(rewards) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
        advantages += [(r - mean) / (std + 1e-4) if scale_rewards == "group" else r - mean for r in rewards]
    assert any(a != 0 for a in advantages)
    if loss_type == "dapo":
        want = -sum(a * c for a, c in zip(advantages, tokens)) / sum(tokens)
    elif loss_type == "grpo":
        want = -sum(advantages) / 8
    else:
        want = -sum(a * c for a, c in zip(advantages, tokens)) / (8 * 6)
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_ranks_scaled_by_world_over_the_global_denominator_average_to_the_whole_batch(loss_type):
    """FSDP averages the ranks' gradients: each rank's weighted sum x world / the update's denominator (counted
    over every rank) then gives the whole batch's gradient, for each loss type."""
    torch.manual_seed(0)
    logp = torch.randn(6, 5, requires_grad=True)
    mask = torch.rand(6, 5) > 0.3
    advantages = torch.randn(6)

    def objective(rows, world):
        m = mask[rows]
        tokens, n = float(mask.sum()), float(mask.shape[0])  # the update's counts, every rank's together
        denominator = loss_denominator(loss_type, tokens, n, max_new_tokens=5)
        per_token, _ = clipped_surrogate(logp[rows], logp[rows].detach(), advantages[rows], 0.2, 0.28)
        return (per_token * token_weights(loss_type, m)).sum() * world / denominator

    (whole,) = torch.autograd.grad(objective(slice(0, 6), 1), logp)
    halves = [torch.autograd.grad(objective(rows, 2), logp)[0] for rows in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, whole)


def test_one_k_per_group_in_the_samplers_proportions_and_dynamic_sampling_keeps_them(tmp_path, sft_model):  # noqa: F811
    """Seven groups of two at 4:1:1:1 (stratified): every step draws k = 1 for four groups and each other k for
    one, a group's completions all at its k. Dynamic sampling replaces the groups without signal with fresh
    ones at the same k and leaves the others as they were."""
    shape = ["--rl.group_size", "2", "--training.global_batch_size", "14", "--training.local_batch_size", "2"]
    plain = trainer(tmp_path / "plain", sft_model, *shape)
    refill = trainer(tmp_path / "refill", sft_model, *shape, "--rl.dynamic_sampling_rounds", "3")
    try:
        for step in (1, 2, 3):
            batch, again = plain.rollout(step), refill.rollout(step)
            groups = [batch.loops[2 * g : 2 * g + 2] for g in range(7)]
            assert all(len(set(g)) == 1 for g in groups)
            counts = [sum(g[0] == k for g in groups) for k in (1, 2, 3, 4)]
            assert counts == [4, 1, 1, 1], (step, counts)
            assert again.loops == batch.loops  # each place keeps its k
            empty = without_signal(batch.rewards, 2)
            for g in range(7):
                rows = slice(2 * g, 2 * g + 2)
                if g not in empty:
                    assert (
                        again.completions[rows] == batch.completions[rows]
                        and again.prompts[rows] == batch.prompts[rows]
                    )
            assert len(without_signal(again.rewards, 2)) <= len(empty)
            assert refill.refilled == len(empty)
    finally:
        plain.close()
        refill.close()


def test_the_clip_binds_once_minibatches_split_the_batch(tmp_path, sft_model):  # noqa: F811
    """With one update per batch the ratio is 1 and the clip cannot act: a clip range of [0.01, 101] trains the
    same weights as [0.8, 1.28]. With `rl.minibatches 2` the second update's ratio is against the policy that
    sampled, after the first update moved it (lr 1e-2): the clip takes over some tokens and changes that
    update's gradient."""
    wide = ["--rl.clip_low", "0.99", "--rl.clip_high", "100"]
    runs = {}
    for name, extra in {
        "one": [],
        "one_wide": wide,
        "two": ["--rl.minibatches", "2"],
        "two_wide": ["--rl.minibatches", "2", *wide],
    }.items():
        t = trainer(tmp_path / name, sft_model, *extra)
        try:
            stats = t.train_step(1).scalars
            runs[name] = (stats, torch.cat([p.detach().flatten() for p in t.model.parameters()]))
        finally:
            t.close()
    assert runs["one"][0]["rl/clip_frac"] == 0 and torch.equal(runs["one"][1], runs["one_wide"][1])
    assert runs["two"][0]["rl/clip_frac"] > 0 and runs["two_wide"][0]["rl/clip_frac"] == 0
    assert runs["two"][0]["grad_norm"] != pytest.approx(runs["two_wide"][0]["grad_norm"], rel=1e-4)
    assert not torch.equal(runs["two"][1], runs["two_wide"][1])


def test_k3_averages_to_the_exact_kl_on_a_small_categorical():
    """Monte-Carlo: over 200,000 draws from pi, the mean of k3 is KL(pi || pi_ref) within 5 standard errors of
    the mean (its spread measured on the same draws)."""
    gen = torch.Generator().manual_seed(0)
    logits, ref_logits = (
        torch.randn(6, generator=gen, dtype=torch.float64),
        torch.randn(6, generator=gen, dtype=torch.float64),
    )
    logp, ref = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    exact = (logp.exp() * (logp - ref)).sum().item()
    draws = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=gen)
    k3 = k3_kl(logp[draws], ref[draws])
    standard_error = (k3.std() / math.sqrt(len(draws))).item()
    assert exact > 0.1 and abs(k3.mean().item() - exact) < 5 * standard_error, (k3.mean().item(), exact)
    assert (k3 >= 0).all()


def test_rltt_loop_weights_and_their_gradient():
    """uniform 1/k, progressive t^alpha / sum s^alpha; at ratio 1 the loss's gradient on loop t's log-prob is
    -A w_t per token (RLTT's Eq. 6, with the loss type's token weights)."""
    torch.testing.assert_close(loop_weights("uniform", 4), torch.full((4,), 0.25, dtype=torch.float64))
    torch.testing.assert_close(loop_weights("progressive", 4), torch.tensor([1, 2, 3, 4], dtype=torch.float64) / 10)
    torch.testing.assert_close(loop_weights("progressive", 3, 2.0), torch.tensor([1, 4, 9], dtype=torch.float64) / 14)
    assert loop_weights("last", 3).tolist() == [0.0, 0.0, 1.0]
    cfg = load_config(DEBUG_TOML, ["--rl.loop_credit", "progressive", "--rl.loss_type", "grpo"])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    m = Micro([0, 1], [3, 3], None, mask, token_weights("grpo", mask), None, None, torch.tensor([1.0, -2.0]))
    logp = torch.randn(3, 2, 3, requires_grad=True)
    parts = micro_loss(cfg, m, logp, torch.zeros(3, 2, 3), logp.detach(), None, None)
    parts.loss.backward()
    w = torch.tensor([1, 2, 3]) / 6
    want = -w[:, None, None] * m.advantages[None, :, None] * m.weights[None].float()
    torch.testing.assert_close(logp.grad, want)


def test_dapos_soft_overlong_punishment():
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(20, 20, 0) == 0.0


@pytest.mark.parametrize("poisoned", [{0}, {0, 1}])
def test_an_update_whose_reduced_loss_is_not_finite_is_skipped(tmp_path, sft_model, monkeypatch, poisoned):  # noqa: F811
    """The non-finite guard decides per update on the loss summed over the update's microbatches (and ranks),
    not on the gradient alone: a loss made infinite by a constant keeps a finite gradient, yet its update is
    skipped and the next minibatch's is applied; with both minibatches poisoned the weights do not move."""
    import dataclasses

    import elr.rl.trainer as rl_trainer

    calls = []

    def poisoned_loss(*args, **kwargs):
        parts = micro_loss(*args, **kwargs)
        calls.append(len(calls))
        if calls[-1] in poisoned:  # one microbatch per minibatch here: call i is minibatch i's
            parts = dataclasses.replace(parts, loss=parts.loss + math.inf)
        return parts

    monkeypatch.setattr(rl_trainer, "micro_loss", poisoned_loss)
    t = trainer(tmp_path, sft_model, "--rl.minibatches", "2", "--training.local_batch_size", "4")
    try:
        before = torch.cat([p.detach().flatten().clone() for p in t.model.parameters()])
        stats = t.train_step(1).scalars
        after = torch.cat([p.detach().flatten() for p in t.model.parameters()])
    finally:
        t.close()
    assert len(calls) == 2 and math.isfinite(stats["grad_norm"]) and stats["loss/train"] == math.inf
    assert t.nonfinite.streak == (2 if poisoned == {0, 1} else 0)
    assert torch.equal(before, after) == (poisoned == {0, 1})
