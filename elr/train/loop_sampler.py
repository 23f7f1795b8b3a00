"""Loop counts for mixed-depth training (docs/DESIGN.md §3.5).

The unit is a slot = (data-parallel rank, microbatch); every slot of an optimizer update gets a
loop count k in 1..K. Draws depend only on (seed, step), so a resumed or resharded run draws the
same counts and no sampler state needs saving.

Three modes. `independent`: every slot draws its own k. `synchronized`: one k for the whole update.
`stratified`: one k per microbatch, shared by every data-parallel rank, and the microbatches of an
update spread over the distribution by systematic sampling (n equally spaced quantiles from one
random offset, then shuffled), so an update with n microbatches holds each depth in proportion to its
weight, within one microbatch. Under FSDP every microbatch waits for its slowest rank: independent
draws pay for the deepest of the ranks' draws on every microbatch (1.43x step time at 8 ranks for
koi4b's sampling, scripts/estimate_cost.py), stratified and synchronized draws pay only for the
override's ranks idling at k=1.

The one-loop override is the paper's "rotating subset
of data-parallel ranks runs one loop on every microbatch": in each update a rotating fraction f of
the ranks runs k=1 on all of its microbatches, whatever was drawn for them. With uniform draws
p(k=1) = f + (1 - f) / K, in either sampling mode.

Expert parallelism: the ranks of one expert-parallel group exchange tokens inside every MoE layer,
so they must run the same k on every microbatch. Draws are then made per group (one row of draws
shared by the group's ranks) and the override rotates whole groups. When one group spans every
rank, rotating it would set whole updates to k=1; the override then rotates over the group's
microbatch slots instead (our choice, keeping depths mixed within each update). A single process
is one group too, and rotates over its slots in the same way: with independent or synchronized draws
one process with n microbatches draws what n ranks of one microbatch each would. A process standing in
for a cluster (`elr.emulated_ranks` R) instead lays its microbatches out as R ranks x n / R
microbatches and draws exactly what R ranks would.

A loop-count schedule (`elr.loop_weights_start`, `elr.loop_schedule_steps`) blends the weights of
the first mixed-depth update linearly into `loop_weights`: the weights are a function of the step,
so draws still depend only on (seed, step).

`DepthSchedule` puts the late switch in front of the sampler: the one place that says which phase a
step belongs to.
"""

from __future__ import annotations

import math

import torch

from elr.config import ELR, JobConfig, switch_step
from elr.config.job import check_loop_weights
from elr.config.keys import check_choice, choices
from elr.errors import ConfigError

SAMPLING = choices(ELR, "sampling")  # the field's Literal: the one list of modes


def mix_seed(seed: int, step: int) -> int:
    """A 32-bit generator seed from (seed, step), well mixed (the Mersenne Twister keeps only 32 bits of a
    seed): the loop draws here, and any draw that must follow (seed, step) alone, as RL's sampling does."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 29)) & 0xFFFFFFFF


class LoopSampler:
    def __init__(
        self,
        max_loops: int,
        sampling: str = "independent",
        one_loop_override: float = 0.0,
        loop_weights: list[float] | None = None,
        seed: int = 0,
        start_weights: list[float] | None = None,
        schedule_steps: int = 0,
        schedule_from: int = 0,
    ):
        # A sampler built from other values than a checked config (scripts, studies) guards itself with the
        # config's own checks.
        check_choice("elr.sampling", sampling, SAMPLING)
        self.max_loops, self.sampling, self.override, self.seed = max_loops, sampling, one_loop_override, seed
        self.probs = self._normalised(loop_weights, "elr.loop_weights")  # after any schedule: the closed forms'
        # The schedule: start_probs at update schedule_from + 1, blended into probs over schedule_steps updates.
        self.start_probs = self._normalised(start_weights, "elr.loop_weights_start") if schedule_steps else None
        self.schedule_steps, self.schedule_from = schedule_steps, schedule_from

    def _normalised(self, weights: list[float] | None, key: str) -> torch.Tensor:
        """p(k) from weights over k = 1..K; none: uniform."""
        if weights:
            check_loop_weights(key, weights, self.max_loops)
        w = torch.tensor(weights or [1.0] * self.max_loops, dtype=torch.float64)
        return w / w.sum()

    def probs_at(self, step: int) -> torch.Tensor:
        """p(k) for update `step`: `probs`, or along the schedule, start_probs at its first update."""
        if self.start_probs is None:
            return self.probs
        t = min(max(step - 1 - self.schedule_from, 0) / self.schedule_steps, 1.0)
        return (1 - t) * self.start_probs + t * self.probs

    def sample(self, step: int, n_ranks: int, n_micro: int, group_size: int = 1) -> torch.Tensor:
        """Loop counts [n_ranks, n_micro] for optimizer step `step` (1-based); each run of `group_size`
        consecutive ranks (an expert-parallel group) shares one row."""
        n_groups = n_ranks // group_size
        n = n_groups * n_micro
        gen = torch.Generator().manual_seed(mix_seed(self.seed, step))
        probs = self.probs_at(step)
        if self.sampling == "stratified":
            ks = self._stratified(n_micro, probs, gen).expand(n_groups, n_micro).clone()
        else:
            draws = 1 if self.sampling == "synchronized" else n
            ks = torch.multinomial(probs, draws, replacement=True, generator=gen) + 1
            ks = ks.expand(n).clone().view(n_groups, n_micro)
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

    def _stratified(self, n: int, probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """n loop counts at the quantiles (j + u) / n of the distribution, in random order: each k
        appears floor or ceil of n * p_k times."""
        quantiles = (torch.arange(n, dtype=torch.float64) + torch.rand((), dtype=torch.float64, generator=gen)) / n
        cdf = probs.cumsum(0)
        ks = torch.searchsorted(cdf, quantiles, right=True).clamp(max=self.max_loops - 1) + 1
        return ks[torch.randperm(n, generator=gen)]

    def p_one_loop(self) -> float:
        """Closed-form probability that a slot runs k=1 (after any schedule)."""
        return self.override + (1 - self.override) * self.probs[0].item()

    def mean_loops(self) -> float:
        """Closed-form mean loop count per slot (after any schedule)."""
        ks = torch.arange(1, self.max_loops + 1, dtype=torch.float64)
        return self.override + (1 - self.override) * (self.probs * ks).sum().item()


def wait_factor(ks: torch.Tensor, fixed_cost: float) -> float:
    """Step time over the same work done without waiting, for loop counts ks [ranks, microbatches]
    when every microbatch waits for its slowest rank (FSDP gathers and reduce-scatters each one). A
    microbatch at k costs fixed_cost + k loops: fixed_cost is the rest of the network (embedding,
    input and output blocks, head) in units of one loop."""
    cost = ks.double() + fixed_cost
    return (cost.max(0).values.sum() / cost.sum(1).mean()).item()


def expected_wait(
    sampler: LoopSampler, n_ranks: int, n_micro: int, fixed_cost: float, group_size: int = 1, steps: int = 200
) -> tuple[float, float]:
    """(wait factor, distinct depths per update) of a sampler at a cluster size, over `steps` updates:
    the figures to read before launch."""
    draws = [sampler.sample(step, n_ranks, n_micro, group_size) for step in range(1, steps + 1)]
    cost = torch.stack(draws).double() + fixed_cost  # [steps, ranks, micro]
    factor = (cost.max(1).values.sum() / cost.sum(2).mean(1).sum()).item()
    depths = sum(len(ks.unique()) for ks in draws) / steps
    return factor, depths


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
        self.sampler = LoopSampler(
            e.max_loops,
            e.sampling,
            e.one_loop_override,
            e.loop_weights,
            cfg.training.seed,
            e.loop_weights_start,
            e.loop_schedule_steps,
            schedule_from=self.switch_step,
        )
        self.dp_world, self.n_micro, self.group_size = dp_world, n_micro, group_size
        # One process standing in for a cluster (elr.emulated_ranks): its microbatches are laid out as
        # ranks x microbatches, rank-major, and drawn as that many ranks would draw them. Checked here, not with
        # the config: the data-parallel ranks and the microbatch count are known at launch.
        self.emulated = e.emulated_ranks
        if self.emulated > 1 and (dp_world != 1 or n_micro % self.emulated):
            raise ConfigError(
                f"elr.emulated_ranks: {self.emulated} needs one data-parallel rank (got {dp_world}) "
                f"and a microbatch count it divides (got {n_micro})"
            )

    def mixed_depth(self, updates: int) -> bool:
        """The phase of the model after `updates` optimizer steps."""
        return updates >= self.switch_step

    def loop_fade(self, step: int, fade_steps: int) -> float:
        """The loop gates' fade for update `step` (elr.loop_fade_steps): 0 at the first mixed-depth update (the
        model the one-loop phase left), rising by 1 / fade_steps an update to 1."""
        return min(1.0, max(0, step - 1 - self.switch_step) / fade_steps)

    def by_rank(self, ks: torch.Tensor) -> torch.Tensor:
        """An update's loop counts laid out as the ranks that run them: [ranks, microbatches], the
        emulated ranks' layout in a process standing in for a cluster."""
        return ks.reshape(self.emulated, -1) if self.emulated > 1 else ks

    def loop_counts(self, step: int) -> torch.Tensor:
        """k for every slot [dp_world, n_micro] of update `step`. The ranks of an expert-parallel group
        (group_size) share their k: their all-to-alls run inside the layers."""
        if not self.mixed_depth(step - 1):
            return torch.ones(self.dp_world, self.n_micro, dtype=torch.long)
        if self.emulated > 1:
            return self.sampler.sample(step, self.emulated, self.n_micro // self.emulated).reshape(1, self.n_micro)
        return self.sampler.sample(step, self.dp_world, self.n_micro, group_size=self.group_size)
