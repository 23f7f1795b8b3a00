"""The job config's check: every section's own rules, then the rules across sections; one error naming the key.

Where a rule lives, by what it reads:
    one section          that section's `check()`, beside its fields (elr/config/job.py, rl.py, recurrence.py)
    several sections     here, `check_across_sections`, and nowhere else
    the model code       elr/models/from_config.py (the flavor, the partition and the parallel degrees against
                         the flavor's layers), run by the trainer before any work
    the world size       at launch, when it is known (elr/parallel/parallel_dims.py; the emulated ranks'
                         layout in elr/train/loop_sampler.py)
Plain data: nothing here needs torch, so `python -m elr.config.reference` runs without it.
"""

from __future__ import annotations

import dataclasses

from elr.config.job import JobConfig
from elr.config.keys import require


def switch_step(cfg: JobConfig) -> int:
    """The step at which the late switch happens (elr.switch_at of training.steps, rounded)."""
    return round(cfg.elr.switch_at * cfg.training.steps)


def validate(cfg: JobConfig) -> None:
    """Reject impossible settings before any work starts; one error naming the key."""
    for table in dataclasses.fields(cfg):
        getattr(cfg, table.name).check()
    check_across_sections(cfg)


def check_across_sections(cfg: JobConfig) -> None:
    """The rules that tie a key to another section's: the late switch, the data tasks, the exports, the
    sequence split, and what the RLVR stage asks of the job."""
    e, t, c, p = cfg.elr, cfg.training, cfg.checkpoint, cfg.parallelism
    if e.switch_at > 0:
        step = switch_step(cfg)
        require(
            0 < step < t.steps,
            "elr.switch_at",
            f"x training.steps = {t.steps} rounds to step {step}; the switch must fall after "
            f"step 0 and before the last step {t.steps}",
            e.switch_at,
        )
        require(
            c.enable,
            "checkpoint.enable",
            "must be true when elr.switch_at > 0 (the switch saves and reloads)",
            c.enable,
        )
    require(
        not cfg.job.start_over or c.load_step == -1,
        "job.start_over",
        "starts a new run, which has no checkpoint.load_step to resume from",
        cfg.job.start_over,
    )
    require(
        c.export_format != "hf" or not cfg.data.task,
        "checkpoint.export_format",
        "hf exports a tokenizer; a data.task run has none (use dcp)",
        c.export_format,
    )
    if cfg.data.task:
        require(
            p.context_parallel_degree == 1 and p.tensor_parallel_degree == 1,
            "data.task",
            "runs under data parallelism only (its sequences are tens of tokens): set "
            "parallelism.context_parallel_degree and tensor_parallel_degree to 1",
            cfg.data.task,
        )
    require(
        t.seq_len % p.context_parallel_degree == 0,
        "parallelism.context_parallel_degree",
        f"must divide training.seq_len = {t.seq_len}",
        p.context_parallel_degree,
    )
    require(
        t.seq_len % (p.context_parallel_degree * p.tensor_parallel_degree) == 0,
        "parallelism.tensor_parallel_degree",
        f"x context_parallel_degree must divide training.seq_len = {t.seq_len} (sequence parallelism splits "
        "every context-parallel slice evenly)",
        p.tensor_parallel_degree,
    )
    for key in ("k1_anchor", "loop_consistency"):
        if getattr(e, key):
            require(
                t.loss_chunk_tokens == 0,
                "training.loss_chunk_tokens",
                f"must be 0 with elr.{key} (its KL reads the whole logits of a microbatch)",
                t.loss_chunk_tokens,
            )
            require(
                p.tensor_parallel_degree == 1,
                "parallelism.tensor_parallel_degree",
                f"must be 1 with elr.{key} (its KL reads logits over the whole vocabulary)",
                p.tensor_parallel_degree,
            )
    if e.k1_anchor:
        require(
            p.context_parallel_degree == 1 and p.expert_parallel_degree == 1,
            "elr.k1_anchor",
            "runs under data parallelism only (its teacher is a whole replica on every rank)",
            e.k1_anchor,
        )
    if e.switch_at > 0:
        require(
            switch_step(cfg) + e.switch_heal_steps <= t.steps,
            "elr.switch_heal_steps",
            f"must end by the last step ({t.steps - switch_step(cfg)} updates follow the switch)",
            e.switch_heal_steps,
        )
    if cfg.rl.enable:
        _check_rl_job(cfg)


def _check_rl_job(cfg: JobConfig) -> None:
    """What the RLVR stage asks of the rest of the job (its own keys: `RL.check`, elr/config/rl.py)."""
    r, e, p = cfg.rl, cfg.elr, cfg.parallelism
    require(
        cfg.checkpoint.initial_load_path != "",
        "checkpoint.initial_load_path",
        "must name the model the RLVR stage starts from (the SFT stage's checkpoint or export)",
        "",
    )
    require(
        cfg.training.global_batch_size > 0 and cfg.training.global_batch_size % r.group_size == 0,
        "training.global_batch_size",
        f"must be set to a multiple of rl.group_size = {r.group_size} (the completions of one batch of rollouts: "
        "prompts x group size)",
        cfg.training.global_batch_size,
    )
    require(
        r.loop_credit == "last" or e.prefix_consistent,
        "rl.loop_credit",
        "other than `last` (RLTT's credit to every loop) needs a prefix-consistent recurrence (no budget embedding "
        "in the loops: elr.conditioning_budget = false, or FiLM on the output block only)",
        r.loop_credit,
    )
    require(not cfg.data.task, "data.task", "is not an RLVR prompt source (use rl.prompts)", cfg.data.task)
    require(
        e.switch_at == 0 and not e.loss_every_loop,
        "elr.switch_at",
        "and elr.loss_every_loop are pretraining options; the RLVR stage draws one k per group",
        e.switch_at,
    )
    require(
        p.context_parallel_degree == 1 and p.tensor_parallel_degree == 1 and p.expert_parallel_degree == 1,
        "parallelism",
        "the RLVR stage runs under data parallelism only (rollouts decode through the inference "
        "cache, which runs without TP, CP or EP groups)",
        "tp/cp/ep > 1",
    )
