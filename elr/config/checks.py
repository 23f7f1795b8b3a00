"""The job config's checks: impossible settings rejected before any work starts, one error naming the key.

The checks that need the model code (flavor names, the partition against the flavor's layer count)
are in elr/models/from_config.py; the recurrence's own options check themselves
(elr/config/recurrence.py, `RecurrenceOptions.check`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

from elr.config.job import JobConfig
from elr.errors import ConfigError
from elr.text.tasks import TASKS

CHOICES = {
    "elr.sampling": ("independent", "synchronized", "stratified"),
    "elr.switch_conditioning": ("at_switch", "from_start"),
    "data.task": ("", *TASKS),
    "training.mixed_precision_param": ("float32", "bfloat16"),
    "optimizer.name": ("adamw", "muon"),
    "lr_scheduler.decay_type": ("cosine", "wsd"),
    "checkpoint.export_dtype": ("none", "float32", "bfloat16"),
    "checkpoint.export_format": ("dcp", "hf"),
    "activation_checkpoint.mode": ("none", "selective", "full"),
    "rl.rollout_kv": ("last_loop_kv", "per_loop", "last_loop"),  # elr/infer/cache.py's MODES (a test holds them equal)
    "rl.advantage": ("grpo", "dr_grpo"),
    "rl.loop_credit": ("last", "every_loop"),
    "rl.answer_format": ("last_number", "boxed", "text"),
}


def switch_step(cfg: JobConfig) -> int:
    """The step at which the late switch happens (elr.switch_at of training.steps, rounded)."""
    return round(cfg.elr.switch_at * cfg.training.steps)


def _check(ok: bool, key: str, message: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message} (got {value!r})")


def validate(cfg: JobConfig) -> None:
    """Reject impossible settings before any work starts; one error naming the key.

    The checks that need the model code (flavor, partition vs the flavor's layers) are in
    elr/models/from_config.py, which the trainer runs first.
    """
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _check(value in allowed, key, f"must be one of {', '.join(allowed)}", value)

    for section in dataclasses.fields(cfg):  # inf or nan passes comparisons like lr > 0
        for key, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            numbers = value if isinstance(value, list) else [value]
            _check(
                all(math.isfinite(x) for x in numbers if isinstance(x, float)),
                f"{section.name}.{key}",
                "must be a finite number",
                value,
            )

    e = cfg.elr
    e.check()  # the recurrence's options (elr/config/recurrence.py)
    if e.partition:
        _check(
            len(e.partition) == 3 and all(n >= 0 for n in e.partition),
            "elr.partition",
            "must be three non-negative layer counts [L_in, L_rec, L_out]",
            e.partition,
        )
        _check(e.partition[1] >= 1, "elr.partition", "the recurrent block needs at least one layer", e.partition)
    _check(e.emulated_ranks >= 1, "elr.emulated_ranks", "must be >= 1", e.emulated_ranks)
    _check(0.0 <= e.one_loop_override <= 1.0, "elr.one_loop_override", "must lie in [0, 1]", e.one_loop_override)
    for key in ("loop_weights", "loop_weights_start"):
        weights = getattr(e, key)
        if weights:
            _check(len(weights) == e.max_loops, f"elr.{key}", f"needs one weight per k in 1..{e.max_loops}", weights)
            _check(
                all(w >= 0 for w in weights) and sum(weights) > 0,
                f"elr.{key}",
                "must be non-negative with a positive sum",
                weights,
            )
    _check(e.loop_schedule_steps >= 0, "elr.loop_schedule_steps", "must be >= 0", e.loop_schedule_steps)
    _check(
        bool(e.loop_weights_start) == (e.loop_schedule_steps > 0),
        "elr.loop_schedule_steps",
        "and elr.loop_weights_start go together: a schedule needs both (or neither)",
        e.loop_schedule_steps,
    )
    _check(e.step_lr_scale > 0, "elr.step_lr_scale", "must be > 0", e.step_lr_scale)
    _check(e.step_weight_decay >= 0, "elr.step_weight_decay", "must be >= 0", e.step_weight_decay)
    _check(e.loop_gate_lr_scale > 0, "elr.loop_gate_lr_scale", "must be > 0", e.loop_gate_lr_scale)
    _check(e.loop_fade_steps >= 0, "elr.loop_fade_steps", "must be >= 0 (0: no fade)", e.loop_fade_steps)
    _check(
        e.identity_loops or not e.loop_fade_steps,
        "elr.loop_fade_steps",
        "needs elr.identity_loops = true (the fade opens its gates)",
        e.loop_fade_steps,
    )
    _check(0.0 <= e.switch_at < 1.0, "elr.switch_at", "must lie in [0, 1)", e.switch_at)
    if e.loss_every_loop:
        _check(
            e.prefix_consistent,
            "elr.loss_every_loop",
            "needs elr.conditioning_budget = false (with the budget embedding loop i of a k-loop run is "
            "not the model at budget i)",
            e.loss_every_loop,
        )
    if e.switch_at > 0:
        step = switch_step(cfg)
        _check(
            0 < step < cfg.training.steps,
            "elr.switch_at",
            f"x training.steps = {cfg.training.steps} rounds to step {step}; the switch must fall after "
            f"step 0 and before the last step {cfg.training.steps}",
            e.switch_at,
        )
    _check(
        e.switch_at > 0 or not e.stop_at_switch,
        "elr.stop_at_switch",
        "needs a late switch (elr.switch_at > 0)",
        e.stop_at_switch,
    )
    _check(
        e.conditioning or e.switch_conditioning == "at_switch",
        "elr.switch_conditioning",
        "from_start needs elr.conditioning = true",
        e.switch_conditioning,
    )
    if not e.enabled:
        _check(e.max_loops == 1, "elr.max_loops", "must be 1 when elr.enabled = false (the baseline)", e.max_loops)
        _check(not e.conditioning, "elr.conditioning", "needs elr.enabled = true", e.conditioning)
        _check(e.switch_at == 0.0, "elr.switch_at", "needs elr.enabled = true", e.switch_at)

    _check(cfg.moe.bias_update_rate >= 0, "moe.bias_update_rate", "must be >= 0", cfg.moe.bias_update_rate)
    _check(cfg.moe.aux_loss_coeff >= 0, "moe.aux_loss_coeff", "must be >= 0", cfg.moe.aux_loss_coeff)

    t = cfg.training
    _check(t.steps >= 1, "training.steps", "must be >= 1", t.steps)
    _check(t.seq_len >= 1, "training.seq_len", "must be >= 1", t.seq_len)
    _check(t.local_batch_size >= 1, "training.local_batch_size", "must be >= 1", t.local_batch_size)
    _check(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        "training.global_batch_size",
        "must be -1 or >= 1",
        t.global_batch_size,
    )
    _check(t.max_norm >= 0, "training.max_norm", "must be >= 0", t.max_norm)
    _check(t.max_nonfinite_steps >= 0, "training.max_nonfinite_steps", "must be >= 0", t.max_nonfinite_steps)
    _check(t.loss_chunk_tokens >= 0, "training.loss_chunk_tokens", "must be >= 0 (0 = off)", t.loss_chunk_tokens)

    o = cfg.optimizer
    _check(o.lr > 0, "optimizer.lr", "must be > 0", o.lr)
    _check(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        "optimizer.betas",
        "must be two numbers in [0, 1)",
        o.betas,
    )
    _check(o.eps > 0, "optimizer.eps", "must be > 0", o.eps)
    _check(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", o.weight_decay)
    _check(0 <= o.muon_momentum < 1, "optimizer.muon_momentum", "must lie in [0, 1)", o.muon_momentum)

    s = cfg.lr_scheduler
    _check(s.warmup_steps >= 0, "lr_scheduler.warmup_steps", "must be >= 0", s.warmup_steps)
    _check(0 < s.decay_fraction <= 1, "lr_scheduler.decay_fraction", "must lie in (0, 1]", s.decay_fraction)
    _check(0 <= s.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio", "must lie in [0, 1]", s.min_lr_ratio)

    for key, sha in (("tokenizer.sha256", cfg.tokenizer.sha256), ("data.meta_sha256", cfg.data.meta_sha256)):
        _check(
            sha == "" or (len(sha) == 64 and all(ch in "0123456789abcdef" for ch in sha)),
            key,
            "must be empty or 64 lowercase hex digits",
            sha,
        )

    c = cfg.checkpoint
    _check(c.interval >= 1, "checkpoint.interval", "must be >= 1", c.interval)
    _check(c.keep_latest_k >= 0, "checkpoint.keep_latest_k", "must be >= 0", c.keep_latest_k)
    _check(c.load_step >= -1, "checkpoint.load_step", "must be -1 (latest) or a step", c.load_step)
    _check(c.enable or not c.create_seed, "checkpoint.create_seed", "needs checkpoint.enable = true", c.create_seed)
    _check(
        not cfg.job.start_over or c.load_step == -1,
        "job.start_over",
        "starts a new run, which has no checkpoint.load_step to resume from",
        cfg.job.start_over,
    )
    _check(
        c.export_format == "dcp" or c.export_dtype != "none",
        "checkpoint.export_format",
        "writes an export only with checkpoint.export_dtype set (float32 or bfloat16)",
        c.export_format,
    )
    _check(
        c.export_format != "hf" or not cfg.data.task,
        "checkpoint.export_format",
        "hf exports a tokenizer; a data.task run has none (use dcp)",
        c.export_format,
    )
    if e.switch_at > 0:
        _check(
            c.enable,
            "checkpoint.enable",
            "must be true when elr.switch_at > 0 (the switch saves and reloads)",
            c.enable,
        )

    d = cfg.data
    if d.task:
        _check(d.task_items >= 2, "data.task_items", "must be >= 2", d.task_items)
        _check(1 <= d.task_max_difficulty, "data.task_max_difficulty", "must be >= 1", d.task_max_difficulty)
        _check(
            d.task_curriculum_steps >= 0,
            "data.task_curriculum_steps",
            "must be >= 0 (0 = off)",
            d.task_curriculum_steps,
        )
        _check(
            cfg.parallelism.context_parallel_degree == 1 and cfg.parallelism.tensor_parallel_degree == 1,
            "data.task",
            "runs under data parallelism only (its sequences are tens of tokens): set "
            "parallelism.context_parallel_degree and tensor_parallel_degree to 1",
            d.task,
        )

    _check(cfg.metrics.log_freq >= 1, "metrics.log_freq", "must be >= 1", cfg.metrics.log_freq)
    _check(
        cfg.profiling.profile_freq >= 2,
        "profiling.profile_freq",
        "must be >= 2 (warm-up steps precede a trace)",
        cfg.profiling.profile_freq,
    )
    for key in ("save_traces_folder", "save_memory_snapshot_folder"):
        _check(getattr(cfg.profiling, key) != "", f"profiling.{key}", "must name a folder", "")
    _check(
        cfg.metrics.peak_tflops >= 0,
        "metrics.peak_tflops",
        "must be >= 0 (0: the device's, if known)",
        cfg.metrics.peak_tflops,
    )
    _check(
        not cfg.metrics.enable_wandb or importlib.util.find_spec("wandb") is not None,
        "metrics.enable_wandb",
        'needs wandb, an optional extra (pip install -e ".[wandb]")',
        cfg.metrics.enable_wandb,
    )
    _check(cfg.validation.freq >= 0, "validation.freq", "must be >= 0", cfg.validation.freq)
    _check(cfg.validation.steps >= 1, "validation.steps", "must be >= 1", cfg.validation.steps)

    p = cfg.parallelism
    _check(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        "parallelism.data_parallel_shard_degree",
        "must be -1 or >= 1",
        p.data_parallel_shard_degree,
    )
    _check(
        p.data_parallel_replicate_degree >= 1,
        "parallelism.data_parallel_replicate_degree",
        "must be >= 1",
        p.data_parallel_replicate_degree,
    )
    _check(
        p.expert_parallel_degree >= 1, "parallelism.expert_parallel_degree", "must be >= 1", p.expert_parallel_degree
    )
    _check(
        p.context_parallel_degree >= 1, "parallelism.context_parallel_degree", "must be >= 1", p.context_parallel_degree
    )
    _check(
        t.seq_len % p.context_parallel_degree == 0,
        "parallelism.context_parallel_degree",
        f"must divide training.seq_len = {t.seq_len}",
        p.context_parallel_degree,
    )
    _check(
        p.tensor_parallel_degree >= 1, "parallelism.tensor_parallel_degree", "must be >= 1", p.tensor_parallel_degree
    )
    _check(
        t.seq_len % (p.context_parallel_degree * p.tensor_parallel_degree) == 0,
        "parallelism.tensor_parallel_degree",
        f"x context_parallel_degree must divide training.seq_len = {t.seq_len} (sequence parallelism splits "
        "every context-parallel slice evenly)",
        p.tensor_parallel_degree,
    )

    if cfg.rl.enable:
        _check_rl(cfg)

    ac = cfg.activation_checkpoint.selective_ac_option
    _check(
        ac == "op" or (ac.isdigit() and int(ac) >= 1),
        "activation_checkpoint.selective_ac_option",
        'must be "op" or a layer interval N >= 1',
        ac,
    )


def _check_rl(cfg: JobConfig) -> None:
    """The RLVR stage's keys (elr/rl), and what the rest of the job must be for it."""
    r, t, e = cfg.rl, cfg.training, cfg.elr
    _check(
        r.prompts != "",
        "rl.prompts",
        'must name a JSONL file of {"prompt", "answer"}, or `arithmetic`, `var_chain`, `pointer_chase`',
        r.prompts,
    )
    _check(
        cfg.checkpoint.initial_load_path != "",
        "checkpoint.initial_load_path",
        "must name the model the RLVR stage starts from (the SFT stage's checkpoint or export)",
        "",
    )
    _check(
        r.group_size >= 2, "rl.group_size", "must be >= 2 (a group's advantages compare its completions)", r.group_size
    )
    _check(
        t.global_batch_size > 0 and t.global_batch_size % r.group_size == 0,
        "training.global_batch_size",
        f"must be set to a multiple of rl.group_size = {r.group_size} (the completions of one batch of rollouts: "
        "prompts x group size)",
        t.global_batch_size,
    )
    _check(r.max_new_tokens >= 1, "rl.max_new_tokens", "must be >= 1", r.max_new_tokens)
    _check(r.temperature > 0, "rl.temperature", "must be > 0 (rollouts sample)", r.temperature)
    _check(0 < r.top_p <= 1, "rl.top_p", "must lie in (0, 1]", r.top_p)
    _check(0 < r.clip_low < 1, "rl.clip_low", "must lie in (0, 1)", r.clip_low)
    _check(r.clip_high > 0, "rl.clip_high", "must be > 0", r.clip_high)
    _check(r.kl_coeff >= 0, "rl.kl_coeff", "must be >= 0 (0: no reference model)", r.kl_coeff)
    _check(r.updates_per_batch >= 1, "rl.updates_per_batch", "must be >= 1", r.updates_per_batch)
    _check(r.eval_prompts >= 1, "rl.eval_prompts", "must be >= 1", r.eval_prompts)
    _check(r.samples_every >= 0, "rl.samples_every", "must be >= 0 (0: never)", r.samples_every)
    module, _, function = r.reward.partition(":")
    _check(
        r.reward == "exact"
        or (module and function and all(part.isidentifier() for part in module.split(".")) and function.isidentifier()),
        "rl.reward",
        "must be `exact` or `module:function` (a Python function of prompt, completion, answer)",
        r.reward,
    )
    _check(
        r.loop_credit == "last" or e.prefix_consistent,
        "rl.loop_credit",
        "every_loop needs a prefix-consistent recurrence (no budget embedding in the loops: elr.conditioning_budget "
        "= false, or FiLM on the output block only)",
        r.loop_credit,
    )
    _check(not cfg.data.task, "data.task", "is not an RLVR prompt source (use rl.prompts)", cfg.data.task)
    _check(
        e.switch_at == 0 and not e.loss_every_loop,
        "elr.switch_at",
        "and elr.loss_every_loop are pretraining options; the RLVR stage draws one k per group",
        e.switch_at,
    )
    p = cfg.parallelism
    _check(
        p.context_parallel_degree == 1 and p.tensor_parallel_degree == 1 and p.expert_parallel_degree == 1,
        "parallelism",
        "the RLVR stage runs under data parallelism only (rollouts decode through the inference "
        "cache, which runs without TP, CP or EP groups)",
        "tp/cp/ep > 1",
    )
