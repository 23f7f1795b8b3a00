"""The late switch through the trainer (issue 57): every function-preserving design computes at every k what k = 1
computes at the first mixed-depth update; what AdamW's first updates of the parameters that first get gradients
there are; a run resumed at or after the switch is the uninterrupted run, to the bit, for every design."""

import pytest
import torch
from trainer_utils import DEBUG_TOML, copy_checkpoint, overrides, records, run

from elr.config import load_config
from elr.train.trainer import Trainer

CKPT = ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0", "--checkpoint.interval", "2"]
# koi4b.toml's [elr] on the debug model (FiLM from the budget on loop 1 and the output block, the state norm,
# stratified draws, a 10% override), K = 4, its heads trained from the start, a switch at 50% of 6 updates (step 3)
KOI = [
    *("--elr.max_loops", "4", "--elr.conditioning_first_loop", "true", "--elr.conditioning_later_loops", "false"),
    *("--elr.conditioning_exit", "true", "--elr.state_norm", "true", "--elr.sampling", "stratified"),
    *("--elr.one_loop_override", "0.1", "--elr.switch_conditioning", "from_start", "--elr.switch_at", "0.5"),
]
IDENTITY = ["--elr.identity_loops", "true", "--elr.loop_gate_lr_scale", "10"]
SCALED = [*IDENTITY, "--elr.loop_fade_steps", "2", "--elr.loop_gate", "scaled", "--elr.loop_gate_floor", "0.5"]
# Every function-preserving design, each as the study runs it (on the scaled fade unless it is the fade).
DESIGNS = {
    "identity_loops": IDENTITY,
    "fade": [*IDENTITY, "--elr.loop_fade_steps", "2"],
    "scaled_fade": SCALED,
    "loop_deltas": [*SCALED, "--elr.loop_delta_rank", "4"],
    "healing": [*SCALED, "--elr.loop_delta_rank", "4", "--elr.switch_heal_steps", "1"],
    "k1_anchor": [*SCALED, "--elr.k1_anchor", "1"],
    "consistency": [*SCALED, "--elr.loop_consistency", "0.5"],
    "rewarm": [*SCALED, "--elr.switch_warmup_steps", "2"],
    "k1_share": [*SCALED, "--elr.loop_weights_start", "0.7,0.1,0.1,0.1", "--elr.loop_schedule_steps", "2"],
}
SWITCH = 3


class FirstMixedUpdate(Trainer):
    """Records, as the first mixed-depth update starts (the fade set for it), the logits of one batch at every k,
    and the loop gates and their optimizer group around that update."""

    def train_step(self, step):
        if step != SWITCH + 1:
            return super().train_step(step)
        inputs = next(iter(self.train_loader)).inputs
        with torch.no_grad():
            self.logits = [self.model(inputs[:1], loops=k) for k in range(1, 5)]
        gates = self.model.recurrent.loop_gates
        group = next(
            (g for g in self.optimizer.param_groups if gates and any(p is gates.weight for p in g["params"])), {}
        )
        self.gates_before, self.gate_lr = (gates.weight.detach().clone(), group.get("lr")) if gates else (None, None)
        stats = super().train_step(step)
        if gates:
            self.gates_after = gates.weight.detach().clone()
            self.gate_state = {k: v.clone() for k, v in self.optimizer.state[gates.weight].items()}
        return stats


def first_mixed_update(dump, *design) -> FirstMixedUpdate:
    trainer = FirstMixedUpdate(load_config(DEBUG_TOML, overrides(dump, 2 * SWITCH, *CKPT, *KOI, *design)))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.mark.parametrize("design", list(DESIGNS))
def test_every_k_computes_the_one_loop_model_at_the_first_mixed_update(tmp_path, design):
    logits = first_mixed_update(tmp_path / "run", *DESIGNS[design]).logits
    assert all(torch.equal(logits[k], logits[0]) for k in range(1, 4)), design


def test_the_plain_switch_does_not_and_the_probe_can_tell(tmp_path):
    logits = first_mixed_update(tmp_path / "run").logits
    assert not torch.allclose(logits[1], logits[0])


def test_adam_restarts_nothing_at_the_switch_its_first_steps_of_a_new_loop_are_smaller():
    """torch's AdamW creates a parameter's state at its first step with a gradient: a state created late starts its
    bias correction there (the first update is lr x sign(g)); a state that took zero gradients since step 1 carries
    its step count, so the first real gradient, at step t, moves the parameter by lr x (1 - b1) / (1 - b1^t) /
    sqrt((1 - b2) / (1 - b2^t)) x sign(g): 0.45 lr at the study's switch (t = 301) with betas (0.9, 0.95)."""
    b1, b2, lr, t = 0.9, 0.95, 0.1, 301
    late, carried = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opts = [torch.optim.AdamW([p], lr=lr, betas=(b1, b2), weight_decay=0.0) for p in (late, carried)]
    g = torch.tensor([1e-3, -2.0, 5.0])
    for step in range(1, t + 1):
        for p, opt in zip((late, carried), opts):
            p.grad = g.clone() if step == t else (torch.zeros(3) if p is carried else None)
            opt.step()
    assert opts[0].state[late]["step"].item() == 1 and opts[1].state[carried]["step"].item() == t
    torch.testing.assert_close(late.detach(), -lr * g.sign(), rtol=1e-4, atol=0)
    scale = (1 - b1) / (1 - b1**t) / ((1 - b2) / (1 - b2**t)) ** 0.5
    torch.testing.assert_close(carried.detach(), -lr * scale * g.sign(), rtol=1e-4, atol=0)
    assert scale == pytest.approx(0.447, abs=1e-3)


def test_the_trainers_gates_carry_their_adam_state_from_step_one(tmp_path):
    """One process gives unused parameters zero gradients (as FSDP does), so the identity loops' gates have AdamW
    state from step 1: at the first mixed-depth update (optimizer step t = switch + 1) each gate with a gradient
    moves by lr x (1 - b1) / (1 - b1^t) / sqrt((1 - b2) / (1 - b2^t)), 0.56 lr at t = 4 (docs/recurrence.md)."""
    trainer = first_mixed_update(tmp_path / "run", *IDENTITY)
    t = SWITCH + 1
    assert trainer.gate_state["step"].item() == t  # counted from step 1, never restarted
    b1, b2 = trainer.cfg.optimizer.betas
    moved = (trainer.gates_after - trainer.gates_before).abs()
    scale = (1 - b1) / (1 - b1**t) / ((1 - b2) / (1 - b2**t)) ** 0.5
    # the moments held zeros until this update, so the gradient is exp_avg / (1 - b1); where it dwarfs AdamW's eps
    # the first step's size depends on the step count alone
    used = (trainer.gate_state["exp_avg"] / (1 - b1)).abs() > 1e-4
    assert used.sum() > 10
    torch.testing.assert_close(moved[used], torch.full_like(moved[used], trainer.gate_lr * scale), rtol=1e-3, atol=0)


def test_conditioning_added_at_the_switch_starts_its_adam_state_there(tmp_path):
    """With `switch_conditioning = at_switch` the heads are new at the switch: their state is created at its first
    mixed-depth update (bias correction from 1), while the rest of the model carries its own."""
    dump = tmp_path / "run"
    at_switch = [*CKPT, "--elr.switch_at", "0.5"]
    run(dump, 2 * SWITCH - 2, *at_switch)  # 4 updates: switch at 2, two mixed-depth updates
    trainer = Trainer(load_config(DEBUG_TOML, overrides(dump, 2 * SWITCH - 2, *at_switch)))
    try:
        steps = {
            name: trainer.optimizer.state[p]["step"].item()
            for name, p in trainer.model.named_parameters()
            if p in trainer.optimizer.state
        }
    finally:
        trainer.close()
    heads = [v for name, v in steps.items() if "conditioning" in name]
    assert heads and set(heads) == {2} and steps["tok_embeddings.weight"] == 4


RESUME_DESIGNS = {
    **DESIGNS,
    "all_at_once": [
        *SCALED,
        "--elr.loop_delta_rank",
        "4",
        "--elr.switch_heal_steps",
        "1",
        "--elr.k1_anchor",
        "1",
        "--elr.loop_consistency",
        "0.5",
        "--elr.switch_warmup_steps",
        "2",
    ],
}


def resume_is_exact(tmp_path, design: list[str]) -> None:
    job = [*CKPT, *KOI, *design]
    whole = run(tmp_path / "whole", 2 * SWITCH, *job)
    assert sum(records(tmp_path / "whole")[SWITCH]["loops"], []) != [1] * 2  # mixed depth after the switch
    for step in (SWITCH, SWITCH + 1):  # at the switch (no teacher saved yet) and after it
        dump = tmp_path / f"from{step}"
        copy_checkpoint(tmp_path / "whole", step, dump)
        assert run(dump, 2 * SWITCH, *job) == {s: whole[s] for s in range(step + 1, 2 * SWITCH + 1)}, step


def test_a_run_with_every_design_resumes_at_and_after_the_switch_exactly(tmp_path):
    resume_is_exact(tmp_path, RESUME_DESIGNS["all_at_once"])


@pytest.mark.slow
@pytest.mark.parametrize("design", list(DESIGNS))
def test_each_design_resumes_at_and_after_the_switch_exactly(tmp_path, design):
    resume_is_exact(tmp_path, DESIGNS[design])


@pytest.mark.slow  # multi-process
def test_every_design_on_two_ranks_at_different_k_equals_one_process(tmp_path):
    """FSDP2 on 2 gloo ranks whose loop counts differ (a 50% one-loop override: one rank at k = 1, the other
    deeper), across the switch, with every design at once: the new parameters reduce on every rank, the anchor's
    teacher runs on the k = 1 rank alone, and the losses are one process's (tests/test_distributed.py's pairing)."""
    from trainer_utils import run_script

    designs = [
        *("--elr.switch_at", "0.5", "--elr.switch_conditioning", "from_start", "--elr.conditioning_exit", "true"),
        *("--elr.one_loop_override", "0.5", *RESUME_DESIGNS["all_at_once"]),
    ]
    run(tmp_path / "seed", 2 * SWITCH, *CKPT, *designs, "--checkpoint.create_seed", "true")
    for name in ("two", "one"):
        copy_checkpoint(tmp_path / "seed", 0, tmp_path / name)
    fp32 = ["--training.mixed_precision_param", "float32"]
    two = run_script(tmp_path / "two", 2 * SWITCH, *CKPT, *designs, *fp32, "--training.local_batch_size", "2", nproc=2)
    one = run(tmp_path / "one", 2 * SWITCH, *CKPT, *designs)
    loops = [r["loops"] for r in records(tmp_path / "two")]
    assert any(len(set(column)) > 1 for ks in loops[SWITCH:] for column in zip(*ks)), "ranks should differ in k"
    for step in range(1, 2 * SWITCH + 1):
        assert two[step] == pytest.approx(one[step], rel=2e-5, abs=2e-5), step
