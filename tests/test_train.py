"""End-to-end training on the bundled data: metrics, accumulation, exact resume, the late switch,
bad numbers and preemption."""

import json
import logging
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import DEBUG_TOML, ROOT, copy_checkpoint, losses, overrides, records, run, run_script

from elr.config import load_config
from elr.infer.load import load_model
from elr.train.nonfinite import NonFiniteLossError
from elr.train.optimizer import lr_lambda
from elr.train.trainer import Trainer

CKPT = ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0"]


def test_debug_job_writes_every_metric(tmp_path):
    dump = tmp_path / "run"
    run(dump, 4, "--validation.freq", "2", "--metrics.enable_tensorboard", "true", "--metrics.log_freq", "2")
    recs = records(dump)
    steps = [r for r in recs if "loss/train" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert math.isfinite(r["loss/train"]) and len(r["loops"]) == 1 and len(r["loops"][0]) == 2
        for key in ("lr", "grad_norm", "loops/mean", "throughput/tokens_per_s", "memory/max_gib"):
            assert key in r, key
        assert "throughput/mfu_pct" not in r  # no known peak on a CPU: no MFU rather than 0
        assert any(k.startswith("loss/k") for k in r)
    logged = [r for r in steps if r["step"] % 2 == 0]  # per-loop statistics on log steps
    assert all("loop1/update_norm" in r and "loop1/step_size_mean" in r and "loop1/film_gate_mean" in r for r in logged)
    assert all("moe/max_load_over_mean" in r and "moe/aux_loss" in r for r in steps)
    vals = [r for r in recs if "val/loss_k1" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]
    assert all(set(r) >= {"val/loss_k1", "val/loss_k2", "val/loss_k3"} for r in vals)
    assert list((dump / "tb").glob("events.out.tfevents.*"))
    assert (dump / "config.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dump / "tb"))
    events.Reload()
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n"))["training"]["steps"] == 4  # the run's config, as text
    assert set(events.PluginTagToContent("hparams")) >= {"_hparams_/experiment", "_hparams_/session_start_info"}


def test_gradient_accumulation_equals_one_large_microbatch(tmp_path):
    one_loop = ["--elr.max_loops", "1"]
    accumulated = run(tmp_path / "a", 3, *one_loop)  # two microbatches of 2
    single = run(tmp_path / "b", 3, *one_loop, "--training.local_batch_size", "4")
    for step in accumulated:
        assert accumulated[step] == pytest.approx(single[step], rel=1e-5)


def test_resume_applies_this_jobs_optimizer_settings(tmp_path, caplog):
    """The checkpoint's param groups and scheduler base lrs load, then the job's config wins: the
    peak lr, weight decay and betas it sets, and its schedule at the loaded step."""
    dump = tmp_path / "run"
    run(dump, 2, *CKPT)
    changed = ["--optimizer.lr", "1e-3", "--optimizer.weight_decay", "0.05", "--optimizer.betas", "0.8,0.9"]
    cfg = load_config(DEBUG_TOML, overrides(dump, 4, *CKPT, *changed))
    with caplog.at_level(logging.INFO, logger="elr"):
        trainer = Trainer(cfg)
    trainer.close()
    groups = trainer.optimizer.param_groups
    assert trainer.step == 2 and [g["initial_lr"] for g in groups] == trainer.lr_scheduler.base_lrs == [1e-3] * len(
        groups
    )
    assert [g["lr"] for g in groups] == [1e-3 * lr_lambda(2, cfg.lr_scheduler, 4)] * len(groups)
    assert groups[0]["weight_decay"] == 0.05 and all(g["betas"] == (0.8, 0.9) for g in groups)
    lines = [r.getMessage() for r in caplog.records if "changed on resume" in r.getMessage()]
    assert (
        len(lines) == 1
        and "optimizer.lr 0.006 -> 0.001" in lines[0]
        and "optimizer.weight_decay 0.1 -> 0.05" in lines[0]
    )
    assert "optimizer.betas [0.9, 0.95] -> [0.8, 0.9]" in lines[0] and lines[0].endswith("(from step 3)"), lines


def test_resume_is_bit_exact_at_every_checkpoint(tmp_path):
    full = run(
        tmp_path / "full",
        6,
        *CKPT,
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_save",
        "true",
        "--checkpoint.export_dtype",
        "bfloat16",
    )
    assert (tmp_path / "full" / "checkpoint" / "step-6-model").is_dir()
    for step in (2, 4):
        dump = tmp_path / f"resume{step}"
        copy_checkpoint(tmp_path / "full", step, dump)
        resumed = run(dump, 6, *CKPT, "--checkpoint.interval", "2")
        assert sorted(resumed) == list(range(step + 1, 7))
        for s, loss in resumed.items():
            assert loss == full[s], (step, s)  # to the last bit, loop counts included
        assert [r["loops"] for r in records(dump)] == [r["loops"] for r in records(tmp_path / "full")][step:]


def test_resume_is_bit_exact_with_every_training_aid(tmp_path):
    """The initial-state noise follows the CPU generator a checkpoint saves, the schedule follows the step."""
    aids = [
        *CKPT,
        "--checkpoint.interval",
        "3",
        "--elr.initial_state_noise",
        "0.5",
        "--elr.state_norm",
        "true",
        "--elr.recurrent_input",
        "state_plus_adapted_input",
        "--elr.backprop_loops",
        "2",
        "--elr.depth_scaled_init",
        "true",
        "--elr.loop_weights_start",
        "0,0,1",
        "--elr.loop_schedule_steps",
        "4",
    ]
    full = run(tmp_path / "full", 6, *aids)
    assert sum(records(tmp_path / "full")[0]["loops"], []) == [3, 3]  # the schedule's first update: k = K only
    dump = tmp_path / "resumed"
    copy_checkpoint(tmp_path / "full", 3, dump)
    assert run(dump, 6, *aids) == {s: full[s] for s in (4, 5, 6)}


SWITCH = [*CKPT, "--elr.switch_at", "0.5", "--checkpoint.interval", "100"]


def test_late_switch_in_run_equals_switch_by_resume(tmp_path):
    in_run = run(tmp_path / "in_run", 6, *SWITCH)
    assert all(len(set(sum(r["loops"], []))) == 1 for r in records(tmp_path / "in_run")[:3])  # k=1 before
    assert (tmp_path / "in_run" / "checkpoint" / "step-3").is_dir()  # saved at the switch
    for name, config in [("same_config", SWITCH), ("mixed_depth_config", [*CKPT, "--elr.switch_at", "0"])]:
        dump = tmp_path / name
        copy_checkpoint(tmp_path / "in_run", 3, dump)
        resumed = run(dump, 6, *config)
        assert resumed == {s: in_run[s] for s in (4, 5, 6)}, name


def test_switch_keeps_the_one_loop_model_exactly(tmp_path):
    """At the switch the new zero-initialised conditioning changes no logit at k=1 (or any k)."""
    dump = tmp_path / "run"
    run(dump, 2, *SWITCH)  # switch_at 0.5 of 2 steps: the switch checkpoint is step 1
    trainer = Trainer(load_config(DEBUG_TOML, overrides(dump, 2, *SWITCH, "--checkpoint.load_step", "1")))
    assert trainer.model_args.recurrence.conditioning and trainer.step == 1
    inputs, *_ = next(iter(trainer.train_loader))
    with torch.no_grad():
        after = [trainer.model(inputs, loops=k) for k in (1, 2, 3)]
        trainer._build(mixed_depth=False)
        trainer._load(1)
        assert not trainer.model_args.recurrence.conditioning
        before = [trainer.model(inputs, loops=k) for k in (1, 2, 3)]
    for a, b in zip(after, before):
        assert torch.equal(a, b)


# The recommended recipe (FiLM from the budget on the output block only) with its heads from the start.
FROM_START = [
    *SWITCH,
    "--elr.switch_conditioning",
    "from_start",
    "--elr.conditioning_first_loop",
    "false",
    "--elr.conditioning_later_loops",
    "false",
    "--elr.conditioning_exit",
    "true",
    "--checkpoint.interval",
    "2",
]


@pytest.mark.slow
def test_switch_with_conditioning_from_start_trains_it_at_one_loop_and_resumes_exactly(tmp_path):
    """The heads exist and train through the one-loop phase (at k = 1 they see E_budget[1]); the switch
    changes only the loop counts, and resuming before, at or after it gives the same run."""
    in_run = run(tmp_path / "in_run", 6, *FROM_START)
    assert all(len(set(sum(r["loops"], []))) == 1 for r in records(tmp_path / "in_run")[:3])  # k=1 before
    for step in (2, 3, 4):  # checkpoints every 2 steps and at the switch (3)
        dump = tmp_path / f"resume{step}"
        copy_checkpoint(tmp_path / "in_run", step, dump)
        resumed = run(dump, 6, *FROM_START)
        assert resumed == {s: in_run[s] for s in range(step + 1, 7)}, step
    dump = tmp_path / "mixed_depth_config"  # the switch checkpoint continued as a mixed-depth job
    copy_checkpoint(tmp_path / "in_run", 3, dump)
    assert run(dump, 6, *FROM_START, "--elr.switch_at", "0") == {s: in_run[s] for s in (4, 5, 6)}
    model, _ = load_model(tmp_path / "in_run" / "checkpoint" / "step-2")  # before the switch: the heads are there
    heads = model.recurrent.conditioning.exit_heads
    assert heads and all(head.weight.abs().sum() > 0 for head in heads)  # ... and trained away from their zero init
    dump = tmp_path / "one_model"
    copy_checkpoint(tmp_path / "in_run", 2, dump)
    trainer = Trainer(load_config(DEBUG_TOML, overrides(dump, 4, *FROM_START)))
    model = trainer.model
    trainer.train()
    trainer.close()
    assert trainer.model is model and trainer.mixed_depth  # switched without a rebuild


def shipped_elr(name: str = "koi4b.toml") -> list[str]:
    """A production config's [elr] as command-line overrides (on the debug model), with its late switch at 50%
    if it ships none: the recipe the card's workflow runs."""
    import tomli

    with open(ROOT / "train_configs" / name, "rb") as f:
        elr = tomli.load(f)["elr"]
    elr.setdefault("switch_at", 0.5)
    value = lambda v: ",".join(map(str, v)) if isinstance(v, list) else str(v).lower()  # noqa: E731
    return [arg for key, v in elr.items() for arg in (f"--elr.{key}", value(v))]


def test_the_shipped_recipe_stops_at_its_switch_and_resumes_with_the_same_config_exactly(tmp_path):
    """The card's workflow in one process: koi4b.toml's [elr] runs to the switch, saves and stops
    (elr.stop_at_switch); the same config resumes there; the losses equal an uninterrupted run's."""
    card = [*CKPT, *shipped_elr(), "--checkpoint.interval", "100"]
    whole = run(tmp_path / "whole", 6, *card)
    first = run(tmp_path / "card", 6, *card, "--elr.stop_at_switch", "true")
    assert sorted(first) == [1, 2, 3] and (tmp_path / "card" / "checkpoint" / "step-3").is_dir()
    assert run(tmp_path / "card", 6, *card, "--elr.stop_at_switch", "true") == whole  # metrics.jsonl: steps 1..6


@pytest.mark.slow  # three processes
def test_the_cards_command_stops_at_the_switch_and_the_same_command_resumes_exactly(tmp_path):
    """As a user types it: train.py with koi4b.toml's [elr] stops at the switch; the same command again
    finishes the run; the losses equal an uninterrupted run's, to the bit."""
    card = [*CKPT, *shipped_elr(), "--checkpoint.interval", "100", "--elr.stop_at_switch", "true"]
    whole = run_script(tmp_path / "whole", 6, *card, "--elr.stop_at_switch", "false")
    assert sorted(run_script(tmp_path / "card", 6, *card)) == [1, 2, 3]
    assert run_script(tmp_path / "card", 6, *card) == whole


def test_nonfinite_updates_are_skipped_then_abort(tmp_path):
    dump = tmp_path / "run"
    cfg = load_config(
        DEBUG_TOML, overrides(dump, 6, *CKPT, "--checkpoint.interval", "1", "--training.max_nonfinite_steps", "1")
    )
    trainer = Trainer(cfg)
    poisoned_steps = {2, 4, 5}
    forward, optimizer_step = trainer.model.forward, trainer.optimizer.step
    stepped = []

    def maybe_nan(tokens, **kwargs):
        out = forward(tokens, **kwargs)
        return out * float("nan") if trainer.step + 1 in poisoned_steps else out

    trainer.model.forward = maybe_nan
    trainer.optimizer.step = lambda: (stepped.append(trainer.step + 1), optimizer_step())[1]
    with pytest.raises(NonFiniteLossError, match="training.max_nonfinite_steps"):
        trainer.train()
    trainer.close()
    assert stepped == [1, 3]  # step 2 skipped; 4 skipped; 5 is the second in a row: abort
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-1", "step-2", "step-3", "step-4"]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    logged = losses(dump)
    assert math.isnan(logged[2]) and math.isfinite(logged[3])


@pytest.mark.slow  # a process of its own and a real SIGTERM (tests/test_signals.py: the same in this process)
def test_sigterm_saves_a_resumable_checkpoint_and_exits_zero(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *overrides(dump, 100000, *CKPT, "--checkpoint.interval", "100000")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(losses(dump) if (dump / "metrics.jsonl").exists() else {}) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    last = max(losses(dump))
    assert (dump / "checkpoint" / f"step-{last}").is_dir(), out
    resumed = run(dump, last + 1, *CKPT)
    assert max(resumed) == last + 1


def test_baseline_trains_and_validates_one_loop(tmp_path):
    dump = tmp_path / "run"
    run(
        dump,
        2,
        "--elr.enabled",
        "false",
        "--elr.max_loops",
        "1",
        "--elr.conditioning",
        "false",
        "--validation.freq",
        "2",
    )
    val = [r for r in records(dump) if "val/loss_k1" in r][-1]
    assert "val/loss_k2" not in val


def test_one_loop_override_and_cross_entropy_match_a_manual_step(tmp_path):
    """The logged loss of step 1 is the token mean of cross entropy over the slots' own k."""
    dump = tmp_path / "run"
    trainer = Trainer(load_config(DEBUG_TOML, overrides(dump, 1)))
    ks = trainer.depths.loop_counts(1)[0].tolist()
    loader = iter(trainer.train_loader)
    batches = [next(loader) for _ in ks]
    trainer.train_loader.dataset.position = 0
    with torch.no_grad():
        expected = (
            torch.stack(
                [
                    F.cross_entropy(trainer.model(x, loops=k).flatten(0, 1), y.flatten())
                    for (x, y, _), k in zip(batches, ks)
                ]
            )
            .mean()
            .item()
        )
    trainer.train()
    trainer.close()
    assert losses(dump)[1] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow  # the whole quick start: 90 s on an idle 2-core machine
def test_debug_config_learns_real_text(tmp_path):
    """The product's promise: `python train.py` trains on the bundled prose; val loss at k=1 drops >= 30%."""
    dump = tmp_path / "outputs" / "debug"  # the default dump folder, run from tmp_path as a user runs it
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py")], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    val = [r["val/loss_k1"] for r in records(dump) if "val/loss_k1" in r]
    assert val[-1] <= 0.7 * val[0], val
    # the README's next step works at once: the last step is saved (and only it is kept)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-150"]
    generate = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )  # no flags: the quick start's checkpoint
    assert generate.returncode == 0 and generate.stdout.strip(), generate.stderr[-3000:]
    assert "outputs/debug/checkpoint/step-150" in generate.stderr


@pytest.mark.parametrize("coeff", [0.0, 0.5])
def test_aux_loss_adds_coeff_times_its_microbatch_mean_to_the_gradient(tmp_path, coeff):
    """coeff 0 gives cross entropy's gradient alone, exactly as before the aux loss existed."""
    trainer = Trainer(
        load_config(DEBUG_TOML, overrides(tmp_path, 1, "--moe.aux_loss_coeff", str(coeff), "--training.max_norm", "0"))
    )
    model, ks = trainer.model, trainer.depths.loop_counts(1)[0].tolist()
    loader = iter(trainer.train_loader)
    batches = [next(loader) for _ in ks]
    trainer.train_loader.dataset.position = 0
    ce, aux = 0.0, []
    for (x, y, _), k in zip(batches, ks):
        ce = ce + F.cross_entropy(model(x, loops=k).flatten(0, 1), y.flatten(), reduction="sum")
        aux.append(model.moe_aux_loss())
    ce = ce / sum(b.labels.numel() for b in batches)
    params = list(model.parameters())
    router = model.moe_layers()[0].router.weight
    (ce_router,) = torch.autograd.grad(ce, router, retain_graph=True)
    expected = torch.autograd.grad(ce + coeff * torch.stack(aux).mean() if coeff else ce, params)
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()

    grads = {}
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.update({id(p): p.grad.clone() for p in params}))
    scalars = trainer.train_step(1).scalars
    trainer.close()
    for p, want in zip(params, expected):
        torch.testing.assert_close(grads[id(p)], want, rtol=1e-5, atol=1e-8)
    assert ((grads[id(router)] - ce_router).abs().max() > 1e-6) == (coeff > 0)  # the aux term reaches the router
    assert scalars["moe/aux_loss"] == pytest.approx(torch.stack(aux).mean().item(), rel=1e-6)
