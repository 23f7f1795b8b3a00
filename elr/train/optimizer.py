"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine / WSD schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from elr.config import ELR, LRScheduler, Optimizer
from elr.models.recurrence import AdaptiveStep, LoopConditioning

# Parameters of these modules never decay: embeddings and norms carry scale, and the loop
# conditioning must stay free to sit at its identity values. The ELR step has its own group.
NO_DECAY_MODULES = (nn.Embedding, nn.RMSNorm, LoopConditioning)


def param_groups(model: nn.Module, weight_decay: float, lr: float, step: ELR | None = None) -> list[dict]:
    """Decayed matrices, undecayed rest, and the ELR step size with its own lr and decay."""
    no_decay_ids = {
        id(p) for m in model.modules() if isinstance(m, NO_DECAY_MODULES) for p in m.parameters()
    }
    step_ids = {id(p) for m in model.modules() if isinstance(m, AdaptiveStep) for p in m.parameters()}
    decay, no_decay, step_params = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in step_ids:
            step_params.append(p)
        else:
            (decay if p.ndim >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr},
    ]
    if step_params:
        step = step or ELR()
        groups.append({"params": step_params, "weight_decay": step.step_weight_decay, "lr": lr * step.step_lr_scale})
    return groups


def build_optimizer(model: nn.Module, cfg: Optimizer, elr: ELR | None = None) -> torch.optim.AdamW:
    # foreach keeps the update fast on CPU and works with FSDP2's DTensor parameters.
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay, cfg.lr, elr), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
        foreach=True,
    )


def lr_lambda(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak lr after `step` optimizer updates (the scheduler's internal count)."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay_type == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(1, total_steps - decay_start)
    return 1.0 - (1 - cfg.min_lr_ratio) * min(progress, 1.0)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_lambda(step, cfg, total_steps))
