"""AdamW parameter groups and the learning-rate schedules."""

import dataclasses

import pytest
import torch

from elr.config import LRScheduler, Optimizer
from elr.models import build_model, flavors
from elr.train.optimizer import build_lr_scheduler, build_optimizer, lr_lambda


def test_weight_decay_only_on_matrices_outside_norms_embeddings_and_elr_gates():
    args = dataclasses.replace(flavors["debug"], max_loops=3, update="adaptive_delta", conditioning=True, max_seq_len=32)
    model = build_model(args)
    opt = build_optimizer(model, Optimizer(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decayed | plain == set(names.values()) and not decayed & plain
    for name in plain:
        assert ("norm" in name or "embed" in name or "step_size" in name or "conditioning" in name
                or name.endswith(("bias", "A_log", "dt_bias"))), name
    for name in ("output.weight", "recurrent.layers.0.sublayer.q_proj.weight", "recurrent.layers.1.sublayer.w1"):
        assert name in decayed
    for name in ("tok_embeddings.weight", "recurrent.step_size.proj.weight", "recurrent.conditioning.heads.0.weight"):
        assert name in plain


@pytest.mark.parametrize("decay_type", ["cosine", "wsd"])
def test_schedule_warms_up_peaks_and_ends_at_the_minimum(decay_type):
    cfg = LRScheduler(warmup_steps=10, decay_type=decay_type, decay_fraction=0.2, min_lr_ratio=0.01)
    total = 100
    lrs = [lr_lambda(step, cfg, total) for step in range(total + 1)]
    assert lrs[0] == pytest.approx(1 / 11) and max(lrs) == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # warmup rises
    assert lrs[total] == pytest.approx(0.01)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # never rises after warmup
    if decay_type == "wsd":
        assert lrs[10:80] == [1.0] * 70 and lrs[90] == pytest.approx(1 - 0.99 * 0.5)


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, Optimizer(lr=1e-2))
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=4), total_steps=20)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:5] == pytest.approx([1e-2 * (s + 1) / 5 for s in range(5)])
