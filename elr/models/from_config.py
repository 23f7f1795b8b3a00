"""Job config -> ModelArgs: the one place where [model], [elr] and [moe] become a model's shape.

elr/config/job.py is plain data and knows no model; the checks that need the model code (flavor names,
the option strings of the GDP kernels, the partition against the flavor's layer count) live here and raise the same
one-line ConfigError naming the key. The trainer runs them
before any other work, and scripts/estimate_cost.py uses this module without importing the trainer.
"""

from __future__ import annotations

import dataclasses

from elr.config import JobConfig
from elr.config.recurrence import RecurrenceOptions
from elr.errors import ConfigError
from elr.models.args import ModelArgs, flavors
from elr_kernels.gated_delta_product import IMPL_CHOICES


def _check(ok: bool, key: str, message: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message} (got {value!r})")


def check_model_config(cfg: JobConfig) -> None:
    """Reject model settings that no model can be built from; one ConfigError naming the key."""
    _check(cfg.model.flavor in flavors, "model.flavor", f"must be one of {', '.join(flavors)}", cfg.model.flavor)
    _check(
        cfg.model.gdp_impl in IMPL_CHOICES,
        "model.gdp_impl",
        f"must be one of {', '.join(IMPL_CHOICES)}",
        cfg.model.gdp_impl,
    )
    e = cfg.elr
    ep, flavor = cfg.parallelism.expert_parallel_degree, flavors[cfg.model.flavor]
    if ep > 1:
        _check(
            "E" in flavor.layer_pattern,
            "parallelism.expert_parallel_degree",
            f"needs MoE layers; flavor {cfg.model.flavor} is dense",
            ep,
        )
        _check(
            flavor.moe_experts % ep == 0,
            "parallelism.expert_parallel_degree",
            f"must divide the {flavor.moe_experts} experts of flavor {cfg.model.flavor}",
            ep,
        )
    n_layers = len(flavor.layer_pattern)
    if e.partition:
        _check(
            sum(e.partition) == n_layers,
            "elr.partition",
            f"must add up to the {n_layers} layers of flavor {cfg.model.flavor}",
            e.partition,
        )


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
