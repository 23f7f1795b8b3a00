"""Job configuration: dataclass sections, TOML files, `--section.key value` overrides.

Precedence is CLI > TOML > defaults. Every key is typed and validated before any work starts, so a
typo or an impossible setting costs one line of error instead of a crashed job an hour in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import tomli

from elr.config_keys import apply_tables, parse_overrides, set_key
from elr.errors import ConfigError
from elr.tasks import TASKS


@dataclass
class Job:
    description: str = ""
    dump_folder: str = "outputs/debug"  # metrics, TensorBoard, checkpoints and the resolved config go here


@dataclass
class Model:
    flavor: str = "debug"  # a key of elr.models.args.flavors (checked in elr/models/from_config.py)
    # the GDP op's implementation, one of kernels.gated_delta_product.IMPL_CHOICES: auto (triton on CUDA,
    # chunk elsewhere) | triton | chunk | naive (the oracle); decoding takes the one-token step
    gdp_impl: str = "auto"


@dataclass
class ELR:
    enabled: bool = True  # false: the non-recurrent baseline (every layer once, no ELR parameters)
    max_loops: int = 3  # K: loop counts are drawn from 1..K; validation runs every k in 1..K
    partition: list[int] = field(default_factory=list)  # [L_in, L_rec, L_out]; empty: the flavor's
    # the option strings of these two live in elr/models/recurrence.py, next to their code
    recurrent_input: str = "state"  # state | state_plus_input (re-injection from loop 2 on)
    update: str = "adaptive_delta"  # adaptive_delta | replace | residual (s_i = s_{i-1} + r_i)
    # the learned step of adaptive_delta (elr/models/recurrence.py, AdaptiveStep)
    step_input: str = "state"  # what the step sees: state (s~) | delta (r - s) | channel (nothing: per channel)
    step_lr_scale: float = 1.0  # the step's parameters train at optimizer.lr x this
    step_weight_decay: float = 0.0  # weight decay of the step's parameters (pulls the step towards 1)
    conditioning: bool = True  # loop-index/budget embeddings + zero-initialised FiLM heads
    conditioning_budget: bool = True  # E_budget[k] in the conditioning; false: the loop index alone
    conditioning_gate: bool = True  # the FiLM gate (1 + gate) on each sublayer's output; false: scale, shift only
    conditioning_first_loop: bool = True  # false: loop 1 unconditioned (k=1 is exactly the shared block)
    conditioning_later_loops: bool = True  # false: loops 2..k unconditioned (conditioning cannot switch them off)
    conditioning_silu: bool = False  # a SiLU on c = E_loop[i] + E_budget[k] before the FiLM heads (DiT's adaLN)
    loss_every_loop: bool = False  # loss at the exit of every loop 1..k of a slot (their mean); needs
    # no budget embedding (conditioning_budget = false or conditioning = false): one forward at k is then
    # the model at every budget up to k
    sampling: str = "independent"  # independent (each slot draws k) | synchronized (one k per update)
    one_loop_override: float = 0.0  # fraction f of data-parallel ranks that run k=1 on every microbatch (rotating;
    # whole expert groups under expert parallelism, microbatch slots when one group spans every rank)
    loop_weights: list[float] = field(default_factory=list)  # weights over k=1..K; empty: uniform
    switch_at: float = 0.0  # fraction of training.steps run at k=1 before mixed depth starts


@dataclass
class MoE:
    route_replay: bool = False  # recurrent MoE layers reuse loop-1 routes on later loops
    bias_update_rate: float = 1e-3  # aux-loss-free balancing: expert bias step per optimizer update
    aux_loss_coeff: float = 0.0  # sequence-level balance loss weight, per routing call; 0 disables


@dataclass
class Training:
    steps: int = 100
    seq_len: int = 256
    local_batch_size: int = 8  # sequences per microbatch (one slot)
    global_batch_size: int = -1  # sequences per optimizer update; -1: local_batch_size x data-parallel ranks
    max_norm: float = 1.0  # gradient clipping; 0 disables
    seed: int = 0
    mixed_precision_param: str = "float32"  # float32 | bfloat16 (parameters as seen by compute under FSDP)
    max_nonfinite_steps: int = 3  # consecutive NaN/Inf updates skipped before the run aborts
    loss_chunk_tokens: int = 0  # > 0: cross entropy from the hidden states this many tokens at a time; 0 = off


@dataclass
class Optimizer:
    name: str = "adamw"  # adamw | muon (Muon for hidden matrices, AdamW for the rest)
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    muon_momentum: float = 0.95  # muon: momentum of the Muon matrices (Nesterov)


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    decay_type: str = "cosine"  # cosine | wsd (warmup-stable-decay, linear cool-down)
    decay_fraction: float = 0.2  # wsd: fraction of training.steps spent in the final decay
    min_lr_ratio: float = 0.01  # final lr as a fraction of optimizer.lr


@dataclass
class Data:
    path: str = "data/tinyprose"  # folder with train.bin, val.bin and meta.json (scripts/prepare_data.py); a
    # chat folder (--format chat, elr/chat_data.py) serves one conversation per row, assistant tokens scored
    shuffle: bool = True
    # A depth-bound task generated on the fly instead of token files (elr/tasks.py): its own tiny
    # vocabulary, loss on the answer only, validation accuracy per difficulty at every k.
    task: str = ""  # "" (token files) | pointer_chase | var_chain
    task_items: int = 8  # pairs in the context (pointer_chase) or statements (var_chain)
    task_max_difficulty: int = 6  # hops (pointer_chase) or binding depth (var_chain): 1..this
    task_curriculum_steps: int = 0  # updates over which the hardest difficulty drawn grows to the max; 0: off


@dataclass
class Tokenizer:
    path: str = "data/tokenizer/elr8k.tiktoken"  # a tiktoken ranks file, or a tiktoken encoding name
    sha256: str = ""  # the ranks file's SHA-256, checked when set; the trainer records it in config.json


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"  # relative to job.dump_folder
    interval: int = 500  # steps between saves; the last step always saves
    keep_latest_k: int = 3  # 0 keeps every checkpoint
    load_step: int = -1  # -1: resume from the newest complete checkpoint, if any
    async_save: bool = False
    export_dtype: str = "none"  # none | float32 | bfloat16: also write model-only weights at the end
    export_format: str = "dcp"  # dcp (step-N-model/, this package only) | hf (step-N-hf/: safetensors, transformers)
    create_seed: bool = False  # save the initial weights as step 0 and exit (one process): every
    # world size then starts from the same weights, which sharded initialisation does not give
    initial_load_path: str = ""  # start a new run from another run's weights: a step-N folder, a
    # checkpoint folder (its newest step) or a Hugging Face export (scripts/export_hf.py); model only: optimizer, schedule and data position start fresh.
    # Used only when this run has no checkpoint of its own to resume (empty: off)


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = True
    peak_tflops: float = 989.0  # per device, for MFU (H100/H200 dense bf16)


@dataclass
class Validation:
    freq: int = 50  # steps between evaluations (and at the last step); 0 disables
    steps: int = 4  # microbatches per evaluation, at each k


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1  # FSDP; -1: every rank not used by other dimensions
    data_parallel_replicate_degree: int = 1  # HSDP replicas
    expert_parallel_degree: int = 1  # ranks per expert group (each owns E / ep whole experts); 1: off
    # Inside each data-parallel replica: ranks that split one sequence (context parallel) and ranks
    # that split every layer's heads / hidden dims (tensor + sequence parallel); 1 = off. Mesh order:
    # dp_replicate x dp_shard x cp x tp, so a TP group is neighbouring ranks (one node).
    context_parallel_degree: int = 1
    tensor_parallel_degree: int = 1


@dataclass
class Compile:
    enable: bool = False  # torch.compile each layer once; recurrent layers reuse it on every loop


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | selective | full (recompute each layer call in backward)
    selective_ac_option: str = "op"  # selective: "op" (keep matmul/attention outputs) or N (every N-th layer)


@dataclass
class Float8:
    enable: bool = False  # torchao float8 training for the large linear layers


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    elr: ELR = field(default_factory=ELR)
    moe: MoE = field(default_factory=MoE)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "elr.sampling": ("independent", "synchronized"),
    "data.task": ("", *TASKS),
    "training.mixed_precision_param": ("float32", "bfloat16"),
    "optimizer.name": ("adamw", "muon"),
    "lr_scheduler.decay_type": ("cosine", "wsd"),
    "checkpoint.export_dtype": ("none", "float32", "bfloat16"),
    "checkpoint.export_format": ("dcp", "hf"),
    "activation_checkpoint.mode": ("none", "selective", "full"),
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then CLI overrides; validated before returning."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {path}")
        try:
            with open(path, "rb") as f:
                raw = tomli.load(f)
        except tomli.TOMLDecodeError as e:
            raise ConfigError(f"--config: {path} is not valid TOML ({e})") from None
        apply_tables(cfg, raw)
    for key, value in parse_overrides(overrides or []):
        set_key(cfg, key, value)
    validate(cfg)
    return cfg


def config_from_dict(raw: dict) -> JobConfig:
    """A JobConfig from `JobConfig.to_dict()` output, e.g. a run's config.json; validated."""
    cfg = JobConfig()
    apply_tables(cfg, raw)
    validate(cfg)
    return cfg


def switch_step(cfg: JobConfig) -> int:
    """The step at which the late switch happens (elr.switch_at of training.steps, rounded)."""
    return round(cfg.elr.switch_at * cfg.training.steps)


def _check(ok: bool, key: str, message: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message} (got {value!r})")


def validate(cfg: JobConfig) -> None:
    """Reject impossible settings before any work starts; one error naming the key.

    The checks that need the model code (flavor, update rule, recurrent input, partition vs the
    flavor's layers) are in elr/models/from_config.py, which the trainer runs first.
    """
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _check(value in allowed, key, f"must be one of {', '.join(allowed)}", value)

    e = cfg.elr
    _check(e.max_loops >= 1, "elr.max_loops", "must be >= 1", e.max_loops)
    if e.partition:
        _check(len(e.partition) == 3 and all(n >= 0 for n in e.partition), "elr.partition",
               "must be three non-negative layer counts [L_in, L_rec, L_out]", e.partition)
        _check(e.partition[1] >= 1, "elr.partition", "the recurrent block needs at least one layer", e.partition)
    _check(0.0 <= e.one_loop_override <= 1.0, "elr.one_loop_override", "must lie in [0, 1]", e.one_loop_override)
    if e.loop_weights:
        _check(len(e.loop_weights) == e.max_loops, "elr.loop_weights",
               f"needs one weight per k in 1..{e.max_loops}", e.loop_weights)
        _check(all(w >= 0 for w in e.loop_weights) and sum(e.loop_weights) > 0, "elr.loop_weights",
               "must be non-negative with a positive sum", e.loop_weights)
    _check(e.step_lr_scale > 0, "elr.step_lr_scale", "must be > 0", e.step_lr_scale)
    _check(e.step_weight_decay >= 0, "elr.step_weight_decay", "must be >= 0", e.step_weight_decay)
    _check(0.0 <= e.switch_at < 1.0, "elr.switch_at", "must lie in [0, 1)", e.switch_at)
    _check(e.conditioning_first_loop or e.conditioning_later_loops, "elr.conditioning_later_loops",
           "and elr.conditioning_first_loop are both false: no loop is conditioned (set elr.conditioning = false)",
           e.conditioning_later_loops)
    if e.loss_every_loop:
        _check(not (e.conditioning and e.conditioning_budget), "elr.loss_every_loop",
               "needs elr.conditioning_budget = false (with the budget embedding loop i of a k-loop run is "
               "not the model at budget i)", e.loss_every_loop)
    if e.switch_at > 0:
        step = switch_step(cfg)
        _check(0 < step < cfg.training.steps, "elr.switch_at",
               f"x training.steps = {cfg.training.steps} rounds to step {step}; the switch must fall after "
               f"step 0 and before the last step {cfg.training.steps}", e.switch_at)
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
    _check(t.global_batch_size == -1 or t.global_batch_size >= 1, "training.global_batch_size",
           "must be -1 or >= 1", t.global_batch_size)
    _check(t.max_norm >= 0, "training.max_norm", "must be >= 0", t.max_norm)
    _check(t.max_nonfinite_steps >= 0, "training.max_nonfinite_steps", "must be >= 0", t.max_nonfinite_steps)
    _check(t.loss_chunk_tokens >= 0, "training.loss_chunk_tokens", "must be >= 0 (0 = off)", t.loss_chunk_tokens)

    o = cfg.optimizer
    _check(o.lr > 0, "optimizer.lr", "must be > 0", o.lr)
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer.betas",
           "must be two numbers in [0, 1)", o.betas)
    _check(o.eps > 0, "optimizer.eps", "must be > 0", o.eps)
    _check(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", o.weight_decay)
    _check(0 <= o.muon_momentum < 1, "optimizer.muon_momentum", "must lie in [0, 1)", o.muon_momentum)

    s = cfg.lr_scheduler
    _check(s.warmup_steps >= 0, "lr_scheduler.warmup_steps", "must be >= 0", s.warmup_steps)
    _check(0 < s.decay_fraction <= 1, "lr_scheduler.decay_fraction", "must lie in (0, 1]", s.decay_fraction)
    _check(0 <= s.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio", "must lie in [0, 1]", s.min_lr_ratio)

    sha = cfg.tokenizer.sha256
    _check(sha == "" or (len(sha) == 64 and all(ch in "0123456789abcdef" for ch in sha)), "tokenizer.sha256",
           "must be empty or 64 lowercase hex digits", sha)

    c = cfg.checkpoint
    _check(c.interval >= 1, "checkpoint.interval", "must be >= 1", c.interval)
    _check(c.keep_latest_k >= 0, "checkpoint.keep_latest_k", "must be >= 0", c.keep_latest_k)
    _check(c.load_step >= -1, "checkpoint.load_step", "must be -1 (latest) or a step", c.load_step)
    _check(c.enable or not c.create_seed, "checkpoint.create_seed", "needs checkpoint.enable = true", c.create_seed)
    _check(c.export_format == "dcp" or c.export_dtype != "none", "checkpoint.export_format",
           "writes an export only with checkpoint.export_dtype set (float32 or bfloat16)", c.export_format)
    _check(c.export_format != "hf" or not cfg.data.task, "checkpoint.export_format",
           "hf exports a tokenizer; a data.task run has none (use dcp)", c.export_format)
    if e.switch_at > 0:
        _check(c.enable, "checkpoint.enable", "must be true when elr.switch_at > 0 (the switch saves and reloads)",
               c.enable)

    d = cfg.data
    if d.task:
        _check(d.task_items >= 2, "data.task_items", "must be >= 2", d.task_items)
        _check(1 <= d.task_max_difficulty, "data.task_max_difficulty", "must be >= 1", d.task_max_difficulty)
        _check(d.task_curriculum_steps >= 0, "data.task_curriculum_steps", "must be >= 0 (0 = off)",
               d.task_curriculum_steps)
        _check(cfg.parallelism.context_parallel_degree == 1 and cfg.parallelism.tensor_parallel_degree == 1,
               "data.task", "runs under data parallelism only (its sequences are tens of tokens): set "
               "parallelism.context_parallel_degree and tensor_parallel_degree to 1", d.task)

    _check(cfg.metrics.log_freq >= 1, "metrics.log_freq", "must be >= 1", cfg.metrics.log_freq)
    _check(cfg.metrics.peak_tflops > 0, "metrics.peak_tflops", "must be > 0", cfg.metrics.peak_tflops)
    _check(cfg.validation.freq >= 0, "validation.freq", "must be >= 0", cfg.validation.freq)
    _check(cfg.validation.steps >= 1, "validation.steps", "must be >= 1", cfg.validation.steps)

    p = cfg.parallelism
    _check(p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
           "parallelism.data_parallel_shard_degree", "must be -1 or >= 1", p.data_parallel_shard_degree)
    _check(p.data_parallel_replicate_degree >= 1, "parallelism.data_parallel_replicate_degree", "must be >= 1",
           p.data_parallel_replicate_degree)
    _check(p.expert_parallel_degree >= 1, "parallelism.expert_parallel_degree", "must be >= 1",
           p.expert_parallel_degree)
    _check(p.context_parallel_degree >= 1, "parallelism.context_parallel_degree", "must be >= 1",
           p.context_parallel_degree)
    _check(t.seq_len % p.context_parallel_degree == 0, "parallelism.context_parallel_degree",
           f"must divide training.seq_len = {t.seq_len}", p.context_parallel_degree)
    _check(p.tensor_parallel_degree >= 1, "parallelism.tensor_parallel_degree", "must be >= 1", p.tensor_parallel_degree)
    _check(t.seq_len % (p.context_parallel_degree * p.tensor_parallel_degree) == 0, "parallelism.tensor_parallel_degree",
           f"x context_parallel_degree must divide training.seq_len = {t.seq_len} (sequence parallelism splits "
           "every context-parallel slice evenly)", p.tensor_parallel_degree)

    ac = cfg.activation_checkpoint.selective_ac_option
    _check(ac == "op" or (ac.isdigit() and int(ac) >= 1), "activation_checkpoint.selective_ac_option",
           'must be "op" or a layer interval N >= 1', ac)
