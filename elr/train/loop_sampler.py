"""Loop counts for mixed-depth training (docs/DESIGN.md §3.5).

The unit is a slot = (data-parallel rank, microbatch); every slot of an optimizer update gets a
loop count k in 1..K. Draws depend only on (seed, step), so a resumed or resharded run draws the
same counts and no sampler state needs saving. The one-loop override is the paper's "rotating subset
of data-parallel ranks runs one loop on every microbatch": in each update a rotating fraction f of
the ranks runs k=1 on all of its microbatches, whatever was drawn for them. With uniform draws
p(k=1) = f + (1 - f) / K, in either sampling mode.

Expert parallelism: the ranks of one expert-parallel group exchange tokens inside every MoE layer,
so they must run the same k on every microbatch. Draws are then made per group (one row of draws
shared by the group's ranks) and the override rotates whole groups. When one group spans every
rank, rotating it would set whole updates to k=1; the override then rotates over the group's
microbatch slots instead (our choice, keeping depths mixed within each update). A single process
is one group too, and rotates over its slots in the same way: one process with n microbatches draws
what n ranks of one microbatch each would.

`DepthSchedule` puts the late switch in front of the sampler: the one place that says which phase a
step belongs to.
"""

from __future__ import annotations

import math

import torch

from elr.config import JobConfig, switch_step


def _mix(seed: int, step: int) -> int:
    """A 32-bit seed from (seed, step): the Mersenne Twister keeps only 32 bits of a seed."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 29)) & 0xFFFFFFFF


class LoopSampler:
    def __init__(self, max_loops: int, sampling: str = "independent", one_loop_override: float = 0.0,
                 loop_weights: list[float] | None = None, seed: int = 0):
        if sampling not in ("independent", "synchronized"):
            raise ValueError(f"unknown loop sampling {sampling!r}")
        weights = torch.tensor(loop_weights or [1.0] * max_loops, dtype=torch.float64)
        if len(weights) != max_loops or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"loop_weights must be {max_loops} non-negative numbers with a positive sum")
        self.max_loops, self.sampling, self.override, self.seed = max_loops, sampling, one_loop_override, seed
        self.probs = weights / weights.sum()

    def sample(self, step: int, n_ranks: int, n_micro: int, group_size: int = 1) -> torch.Tensor:
        """Loop counts [n_ranks, n_micro] for optimizer step `step` (1-based); each run of `group_size`
        consecutive ranks (an expert-parallel group) shares one row."""
        n_groups = n_ranks // group_size
        n = n_groups * n_micro
        gen = torch.Generator().manual_seed(_mix(self.seed, step))
        draws = 1 if self.sampling == "synchronized" else n
        ks = torch.multinomial(self.probs, draws, replacement=True, generator=gen) + 1
        ks = ks.expand(n).clone()
        ks = ks.view(n_groups, n_micro)
        # Columns [start, end) modulo n_columns run one loop; the window advances by f * n_columns per
        # step, so every column takes its turn and the long-run fraction is exactly f. A column is a
        # group with all its microbatches, or, when there is one group (one process, or one expert
        # group spanning every rank), one microbatch slot: n_micro slots then draw what n_micro
        # one-microbatch groups would, and the override is not all-or-nothing per update (our choice).
        slots = n_groups == 1
        n_columns = n_micro if slots else n_groups
        rotation = self.override * n_columns
        start, end = math.floor((step - 1) * rotation), math.floor(step * rotation)
        overridden = torch.arange(start, end) % n_columns
        if slots:
            ks[:, overridden] = 1
        else:
            ks[overridden] = 1
        return ks.repeat_interleave(group_size, dim=0)

    def p_one_loop(self) -> float:
        """Closed-form probability that a slot runs k=1."""
        return self.override + (1 - self.override) * self.probs[0].item()

    def mean_loops(self) -> float:
        """Closed-form mean loop count per slot."""
        ks = torch.arange(1, self.max_loops + 1, dtype=torch.float64)
        return self.override + (1 - self.override) * (self.probs * ks).sum().item()


class DepthSchedule:
    """The loop counts of every update of a job: one loop through the late switch (elr.switch_at),
    the sampler's draws after it.

    The two phases follow one rule: a model that has taken `updates` optimizer steps is in the
    mixed-depth phase when updates >= switch_step (the trainer builds it with loop conditioning
    then), and update s runs from the model after s - 1. With no late switch, switch_step is 0.
    """

    def __init__(self, cfg: JobConfig, dp_world: int, n_micro: int, group_size: int = 1):
        e = cfg.elr
        self.switch_step = switch_step(cfg)
        self.sampler = LoopSampler(e.max_loops, e.sampling, e.one_loop_override, e.loop_weights, cfg.training.seed)
        self.dp_world, self.n_micro, self.group_size = dp_world, n_micro, group_size

    def mixed_depth(self, updates: int) -> bool:
        """The phase of the model after `updates` optimizer steps."""
        return updates >= self.switch_step

    def loop_counts(self, step: int) -> torch.Tensor:
        """k for every slot [dp_world, n_micro] of update `step`. The ranks of an expert-parallel group
        (group_size) share their k: their all-to-alls run inside the layers."""
        if not self.mixed_depth(step - 1):
            return torch.ones(self.dp_world, self.n_micro, dtype=torch.long)
        return self.sampler.sample(step, self.dp_world, self.n_micro, group_size=self.group_size)
