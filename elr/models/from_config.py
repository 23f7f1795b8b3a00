"""Job config -> ModelArgs: the one place where [model], [elr] and [moe] become a model's shape.

elr/config/ is plain data and knows no model; the checks that need the model code (the flavor's name, the
partition against the flavor's layer count, the expert- and tensor-parallel degrees against its experts and
heads) live here and raise the same one-line ConfigError naming the key. The trainer runs them before any
other work, and scripts/estimate_cost.py uses this module without importing the trainer.
"""

from __future__ import annotations

import dataclasses

from elr.config import JobConfig
from elr.config.keys import require
from elr.config.recurrence import RecurrenceOptions
from elr.models.args import ModelArgs, check_partition, flavors
from elr.models.layers import check_tensor_parallel


def check_model_config(cfg: JobConfig) -> None:
    """Reject model settings that no model can be built from; one ConfigError naming the key."""
    require(cfg.model.flavor in flavors, "model.flavor", f"must be one of {', '.join(flavors)}", cfg.model.flavor)
    e = cfg.elr
    ep, flavor = cfg.parallelism.expert_parallel_degree, flavors[cfg.model.flavor]
    if ep > 1:
        require(
            "E" in flavor.layer_pattern,
            "parallelism.expert_parallel_degree",
            f"needs MoE layers; flavor {cfg.model.flavor} is dense",
            ep,
        )
        require(
            flavor.moe_experts % ep == 0,
            "parallelism.expert_parallel_degree",
            f"must divide the {flavor.moe_experts} experts of flavor {cfg.model.flavor}",
            ep,
        )
    check_tensor_parallel(flavor, cfg.parallelism.tensor_parallel_degree)
    if e.partition:
        check_partition(e.partition, flavor.n_layers, f"flavor {cfg.model.flavor}")


def model_args_from_config(cfg: JobConfig, vocab_size: int, mixed_depth: bool = True) -> ModelArgs:
    """The flavor's backbone with the job's recurrence settings.

    `elr.enabled = false` builds the baseline: `RecurrenceOptions.baseline()` (one loop, `replace`, state
    input, no conditioning), so the baseline has no ELR parameter and elr.update / elr.recurrent_input
    do not apply to it. `mixed_depth` false: the one-loop phase before a late switch, built without the
    loop conditioning that the switch adds (elr/train/loop_sampler.py, DepthSchedule), unless
    `elr.switch_conditioning = "from_start"`: then both phases are one model.
    """
    check_model_config(cfg)
    e = cfg.elr
    flavor = flavors[cfg.model.flavor]
    args = dataclasses.replace(
        flavor,
        vocab_size=vocab_size,
        max_seq_len=cfg.training.seq_len,
        partition=tuple(e.partition) if e.partition else flavor.partition,
        moe_route_replay=cfg.moe.route_replay,
        gdp_impl=cfg.model.gdp_impl,
    )
    if not e.enabled:
        return args
    # Every option by its own name; before the late switch, without the loop conditioning it adds (unless from_start).
    options = RecurrenceOptions.of(e)
    conditioned = mixed_depth or e.switch_conditioning == "from_start"
    return dataclasses.replace(
        args, recurrence=dataclasses.replace(options, conditioning=e.conditioning and conditioned)
    )
