"""AdamW, or Muon + AdamW, with decoupled weight decay on matrices only; warmup + cosine / WSD schedule.

Muon (arXiv 2610.12582, Table 5, trains the 30B with Muon + AdamW) orthogonalises the momentum of
each hidden matrix with torch's Newton-Schulz iteration, exactly as `torch.optim.Muon` does; each
expert of a stacked [E, out, in] MoE weight is its own matrix. AdamW keeps embeddings, the head,
norms, biases, gates and the ELR step size / conditioning.

Under FSDP2 the parameters are DTensors sharded on dim 0. An expert stack sharded on the expert
dim holds whole matrices on every rank: each rank orthogonalises its own experts, no communication.
A 2D matrix split by rows is all-gathered, orthogonalised in full on every rank (the same numbers
everywhere) and each rank keeps its rows: simple and exact, at the price of one all-gather of each
such matrix per step and the Newton-Schulz work repeated on every rank.

The MoE's aux-loss-free expert biases move once per optimizer step too, by load rather than by
gradients: `update_expert_biases` is that step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from elr.config import ELR, JobConfig, LRScheduler, Optimizer, switch_step
from elr.models.ffn import MoE

# Roles (ELRModel.parameter_roles) whose parameters decay: matrices, not norms, vectors, embeddings or
# the loop conditioning, which must stay free to sit at its identity values. The ELR step and the loop
# gates have groups of their own; Muon takes the hidden matrices, AdamW the head, gates, router and everything else.
DECAYED_ROLES = ("matrix", "gate", "router", "head", "conv")
MUON_ROLES = ("matrix",)
# The parameters only loops 2..K use: after a late switch they are what trains in the healing window
# (elr.switch_heal_steps); every other parameter shapes k = 1.
LOOP_SPECIFIC_ROLES = ("loop_gate", "loop_delta")


def param_groups(model: nn.Module, weight_decay: float, lr: float, elr: ELR | None = None) -> list[dict]:
    """Decayed matrices, undecayed rest, then the ELR roles with an lr and decay of their own (from `elr`):
    the adaptive step, `identity_loops`' gates and the later loops' low-rank deltas; the groups of the last two
    say `loop_specific` (the parameters k = 1 never uses)."""
    elr = elr or ELR()
    own = {
        "step_size": (elr.step_lr_scale, elr.step_weight_decay),
        "loop_gate": (elr.loop_gate_lr_scale, 0.0),
        "loop_delta": (1.0, 0.0),
    }
    roles = model.parameter_roles()
    decay, no_decay, by_role = [], [], {role: [] for role in own}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if roles[name] in own:
            by_role[roles[name]].append(p)
        else:
            (decay if roles[name] in DECAYED_ROLES else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr},
    ]
    for role, params in by_role.items():
        if params:
            scale, decay_rate = own[role]
            group = {"params": params, "weight_decay": decay_rate, "lr": lr * scale}
            if role in LOOP_SPECIFIC_ROLES:
                group["loop_specific"] = True
            groups.append(group)
    return groups


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """Hidden matrices: linear weights inside the layers and MoE expert stacks; not the head or gates."""
    roles = model.parameter_roles()
    return [p for name, p in model.named_parameters() if p.requires_grad and roles[name] in MUON_ROLES]


def orthogonalize(update: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz step on each matrix (the last two dims) of `update`.

    A DTensor whose matrices are split across ranks is gathered first and re-split after.
    """
    if isinstance(update, DTensor):
        mesh, placements = update.device_mesh, update.placements
        if any(isinstance(pl, Shard) and pl.dim >= update.ndim - 2 for pl in placements):
            full = update.redistribute(placements=[Replicate()] * mesh.ndim).to_local()
            out = DTensor.from_local(orthogonalize(full), mesh, [Replicate()] * mesh.ndim, run_check=False)
            return out.redistribute(placements=placements)
        local = orthogonalize(update.to_local())
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=update.shape, stride=update.stride())
    matrices = update.reshape(-1, *update.shape[-2:])
    out = torch.empty(matrices.shape, dtype=torch.bfloat16, device=update.device)
    for i, matrix in enumerate(matrices):
        out[i] = _zeropower_via_newtonschulz(matrix, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS)
    return out.view(update.shape)


class MuonAdamW(torch.optim.AdamW):
    """One optimizer, so the LR schedule and checkpoints see one: groups with `muon: True` take
    Muon steps (Nesterov momentum, torch's defaults), the others AdamW's own step.

    Muon's lr is scaled per matrix by 0.2 sqrt(max(out, in)) (torch's "match_rms_adamw"), which
    gives its updates AdamW's RMS, so both share `optimizer.lr` and `optimizer.weight_decay`
    (our choice, after "Muon is Scalable for LLM Training").
    """

    def __setstate__(self, state):
        # Adam's version expects a step count in every parameter's state; Muon's hold a momentum buffer.
        torch.optim.Optimizer.__setstate__(self, state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)
        self.param_groups = [g for g in groups if not g["muon"]]  # AdamW's own step on its groups
        try:
            super().step()
        finally:
            self.param_groups = groups
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = orthogonalize(p.grad.lerp(buf, momentum))
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-_adjust_lr(lr, "match_rms_adamw", p.shape[-2:]))


def build_optimizer(model: nn.Module, cfg: Optimizer, elr: ELR | None = None) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay, cfg.lr, elr)
    # foreach keeps the update fast on CPU and works with FSDP2's DTensor parameters.
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, **kwargs)
    decay, no_decay, *own = groups
    muon_ids = {id(p) for p in muon_params(model)}
    muon = [p for p in decay["params"] if id(p) in muon_ids]
    assert len(muon) == len(muon_ids), "every Muon matrix must be a decayed matrix"
    return MuonAdamW(
        [
            {**decay, "params": muon, "muon": True, "momentum": cfg.muon_momentum},
            {**decay, "params": [p for p in decay["params"] if id(p) not in muon_ids], "muon": False},
            {**no_decay, "muon": False},
            *({**group, "muon": False} for group in own),
        ],
        **kwargs,
    )


@torch.no_grad()
def update_expert_biases(moes: list[MoE], rate: float) -> dict[str, float]:
    """Aux-loss-free balancing: nudge each expert's bias towards the mean load, then reset counts.

    Counts are summed over every rank first (one collective for all layers), so the biases stay
    identical everywhere. Returns load statistics for the metrics.
    """
    if not moes:
        return {}
    loads = torch.stack([m.tokens_per_expert for m in moes])
    if dist.is_initialized():
        dist.all_reduce(loads)
    mean = loads.mean(-1, keepdim=True)
    for moe, load, m in zip(moes, loads, mean):
        moe.expert_bias += rate * torch.sign(m - load)
        moe.tokens_per_expert.zero_()
    imbalance = (loads.max(-1).values / mean.squeeze(-1).clamp(min=1)).mean()
    return {"moe/max_load_over_mean": imbalance.item()}


def lr_lambda(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak lr after `step` optimizer updates (the scheduler's internal count): update
    n of a run uses step n - 1, so the last update, step total_steps - 1, is the one at the minimum."""
    warmup, last = cfg.warmup_steps, total_steps - 1
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay_type == "cosine":
        progress = (step - warmup) / max(1, last - warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(1, last - decay_start)
    return 1.0 - (1 - cfg.min_lr_ratio) * min(progress, 1.0)


@dataclass(frozen=True)
class SwitchLR:
    """What a late switch does to the learning rate, on top of the schedule (elr.switch_warmup_steps,
    elr.switch_heal_steps and elr.switch_heal_lr_scale); `step` is the switch step (elr.switch_at x steps)."""

    step: int = 0
    warmup_steps: int = 0
    heal_steps: int = 0
    heal_lr_scale: float = 1.0

    @classmethod
    def of(cls, cfg: JobConfig) -> SwitchLR:
        e = cfg.elr
        return cls(switch_step(cfg), e.switch_warmup_steps, e.switch_heal_steps, e.switch_heal_lr_scale)

    def factor(self, step: int, loop_specific: bool) -> float:
        """Multiplier of the scheduled lr for scheduler count `step` (update step + 1; the first mixed-depth
        update is step == switch): a linear re-warm from 1 / (warmup + 1) over the first `warmup_steps` updates
        after the switch (every parameter); and in the first `heal_steps`, `heal_lr_scale` for every parameter
        that k = 1 uses (not `loop_specific`), so only the later loops' own parameters move."""
        since = step - self.step
        factor = 1.0
        if not self.step or since < 0:
            return factor
        if since < self.warmup_steps:
            factor = (since + 1) / (self.warmup_steps + 1)
        if since < self.heal_steps and not loop_specific:
            factor *= self.heal_lr_scale
        return factor


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int, switch: SwitchLR | None = None
):
    """The schedule (warmup, then cosine or WSD) of every group, times what a late switch does to each group
    (`switch`: a re-warm, a healing window for the groups that k = 1 uses)."""
    switch = switch or SwitchLR()

    def group_lambda(loop_specific: bool):
        return lambda step: lr_lambda(step, cfg, total_steps) * switch.factor(step, loop_specific)

    lambdas = [group_lambda(group.get("loop_specific", False)) for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


# The hyperparameters a job sets per param group (optimizer.lr as each group's peak lr, weight decay,
# betas, eps, Muon momentum). A checkpoint stores them too; on resume the job's values apply.
JOB_SETTINGS = ("initial_lr", "weight_decay", "betas", "eps", "momentum")


def job_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's job settings, taken from a freshly built optimizer and schedule."""
    return [{k: group[k] for k in JOB_SETTINGS if k in group} for group in optimizer.param_groups]


def apply_job_settings(optimizer: torch.optim.Optimizer, scheduler, settings: list[dict]) -> list[str]:
    """After a checkpoint load, put back this job's settings (`job_settings` before the load) and
    its schedule: the lr of the next update is the configured peak x this job's schedule at the
    loaded step. Returns "name saved -> now" for each setting that differs from the checkpoint's."""
    changes: dict[str, set] = {}
    for group, want in zip(optimizer.param_groups, settings, strict=True):
        for key, value in want.items():
            if group[key] != value:
                changes.setdefault(key, set()).add((group[key], value))
                group[key] = value
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        if group["lr"] != lr:
            changes.setdefault("lr", set()).add((group["lr"], lr))
            group["lr"] = lr
    scheduler._last_lr = lrs
    name = {"initial_lr": "peak lr", "lr": "lr now"}

    def pair(a, b) -> str:
        return f"{a:g} -> {b:g}" if isinstance(a, float) else f"{a} -> {b}"

    return [f"{name.get(k, k)} {', '.join(pair(a, b) for a, b in sorted(v))}" for k, v in changes.items()]
