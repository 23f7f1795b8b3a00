"""Job configuration: dataclass sections, TOML files, `--section.key value` overrides.

Precedence is CLI > TOML > defaults. Every key is typed and validated before any work starts, so a
typo or an impossible setting costs one line of error instead of a crashed job an hour in.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import tomli

from elr.config_keys import apply_tables, check_key, key_type, parse_overrides, set_key
from elr.dump_folder import default_dump_folder
from elr.errors import ConfigError
from elr.tasks import TASKS


@dataclass
class Job:
    """[job]: what each key means (the README table and --help are made from these lines).

    description: free text, saved with the run
    dump_folder: metrics.jsonl, TensorBoard (`tb/`), checkpoints and config.json go here; empty: `outputs/<run_name>`,
        or `outputs/<config file name>` plus `-<data folder>` (or `-<task>`) when the command line changes the data
        (elr/dump_folder.py)
    run_name: names the default dump folder `outputs/<run_name>` (a second run of one config and data beside the
        first); empty: the config file's name; not with `dump_folder` set
    """

    description: str = ""
    dump_folder: str = ""
    run_name: str = ""


@dataclass
class Model:
    """[model]: what each key means (the README table and --help are made from these lines).

    flavor: a flavor of elr/models/args.py (README, Models: `debug`, `gpt_0p5b`, `gdp_hybrid_4b`, ...)
    gdp_impl: the Gated DeltaProduct op's implementation: `auto` (`triton` on CUDA, `chunk` elsewhere), `triton`,
        `chunk` or `naive` (the oracle); decoding one token at a time takes the one-token step of the same choice
        (`chunk` and `naive`: the token loop)
    """

    flavor: str = "debug"
    gdp_impl: str = "auto"


@dataclass
class ELR:
    """[elr]: what each key means (the README table and --help are made from these lines).

    enabled: false: the non-recurrent baseline (every layer once, no ELR parameters; needs `max_loops = 1` and
        `conditioning = false`; `update` and `recurrent_input` do not apply)
    max_loops: K: loop counts are drawn from 1..K; validation runs every k in 1..K
    partition: `[L_in, L_rec, L_out]`, must add up to the flavor's layer count; empty: the flavor's
    recurrent_input: `state` or `state_plus_input` (re-injection of h_in from loop 2 on, the Table 14 ablation; k =
        1 stays the plain stack)
    update: `adaptive_delta` (learned step), `replace` (s_i = r_i) or `residual` (s_i = s_{i-1} + r_i; k = 1 is not
        the plain stack)
    step_input: what `adaptive_delta`'s step a = 2σ(W norm(x) + b) sees: `state` (x = s~_i), `delta` (x = r_i −
        s_{i-1}) or `channel` (no input: one step per channel, a = 2σ(b))
    step_lr_scale: the step's parameters train at `optimizer.lr` × this (their own optimizer group)
    step_weight_decay: weight decay of the step's parameters (pulls W towards 0, the step towards 1)
    conditioning: loop-index/budget embeddings with zero-initialised FiLM heads
    conditioning_budget: the budget embedding E_budget[k] in the conditioning; false: the loop index alone, so the
        first i loops of every budget are the same computation
    conditioning_gate: FiLM's gate term (1 + gate) on each recurrent sublayer's output; false: scale and shift only
    conditioning_first_loop: false: loop 1 unconditioned, so k=1 is exactly the shared block
    conditioning_later_loops: false: loops 2..k unconditioned (only loop 1 has FiLM), so conditioning cannot scale
        the later loops down; not both this and `conditioning_first_loop` false
    conditioning_silu: a SiLU on c = E_loop[i] + E_budget[k] before the FiLM heads (as DiT's adaLN), so a head is
        not additive in i and k
    conditioning_exit: FiLM heads from E_budget[k] on the output block's layers too, so it reads each budget's last
        state in its own way; with both loop options false it is the only conditioning and no loop can be scaled down
    loss_every_loop: the loss at the exit of every loop 1..k of a slot (their mean), not k's alone; needs
        `conditioning_budget = false` or no conditioning
    sampling: `independent` (each slot draws k), `synchronized` (one k per update) or `stratified` (one k per
        microbatch shared by every data-parallel rank, the microbatches of an update spread over the distribution;
        no rank waits for another's loops)
    emulated_ranks: one process only: draw loop counts as this many data-parallel ranks would, its microbatches laid
        out ranks x microbatches (studies that stand in for a cluster); 1: the process is one rank
    one_loop_override: fraction f in [0, 1] of data-parallel ranks that run k=1 on every microbatch (rotating over
        ranks; over whole expert groups under expert parallelism; over microbatch slots when one group spans every
        rank, or in one process)
    loop_weights: K non-negative weights over k = 1..K; empty: uniform
    switch_at: fraction of `training.steps` trained at k=1 before mixed depth; needs checkpoints
    """

    enabled: bool = True
    max_loops: int = 3
    partition: list[int] = field(default_factory=list)
    recurrent_input: str = "state"
    update: str = "adaptive_delta"
    step_input: str = "state"
    step_lr_scale: float = 1.0
    step_weight_decay: float = 0.0
    conditioning: bool = True
    conditioning_budget: bool = True
    conditioning_gate: bool = True
    conditioning_first_loop: bool = True
    conditioning_later_loops: bool = True
    conditioning_silu: bool = False
    conditioning_exit: bool = False
    loss_every_loop: bool = False
    sampling: str = "independent"
    emulated_ranks: int = 1
    one_loop_override: float = 0.0
    loop_weights: list[float] = field(default_factory=list)
    switch_at: float = 0.0


@dataclass
class MoE:
    """[moe]: what each key means (the README table and --help are made from these lines).

    route_replay: recurrent MoE layers reuse loop-1 routes on later loops
    bias_update_rate: aux-loss-free balancing: expert-bias step per optimizer update
    aux_loss_coeff: weight of the sequence-level balance loss (DeepSeek-V3 form, our choice), summed over routing
        calls; under route replay loop 1 only; 0 disables
    """

    route_replay: bool = False
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 0.0


@dataclass
class Training:
    """[training]: what each key means (the README table and --help are made from these lines).

    steps: optimizer updates
    seq_len: tokens per sequence
    local_batch_size: sequences per microbatch (one slot)
    global_batch_size: sequences per update; a multiple of local × data-parallel ranks (the rest is gradient
        accumulation); -1: local × ranks
    max_norm: gradient-norm clipping; 0 disables
    seed: initialisation, data order and loop draws
    mixed_precision_param: `float32` or `bfloat16`: parameter dtype in compute under FSDP (gradients reduce in fp32)
    max_nonfinite_steps: consecutive NaN/Inf updates skipped before the run stops
    loss_chunk_tokens: > 0: cross entropy from the final hidden states this many tokens at a time, each chunk's
        logits recomputed in backward (`elr/train/loss.py`), so only one chunk's logits are ever alive (under TP,
        vocab-parallel: each rank's [chunk, vocab / tp] share); 0: the whole microbatch's logits at once
    """

    steps: int = 100
    seq_len: int = 256
    local_batch_size: int = 8
    global_batch_size: int = -1
    max_norm: float = 1.0
    seed: int = 0
    mixed_precision_param: str = "float32"
    max_nonfinite_steps: int = 3
    loss_chunk_tokens: int = 0


@dataclass
class Optimizer:
    """[optimizer]: what each key means (the README table and --help are made from these lines).

    name: `adamw`, or `muon`: Muon for hidden matrices (each expert its own), AdamW for embeddings, head, norms,
        biases, gates (router, GDP decay/beta) and ELR heads
    lr: peak learning rate (Muon's is scaled per matrix by 0.2·sqrt(max(out, in)) to match AdamW's update RMS)
    betas: AdamW's (beta1, beta2); on the command line a comma-separated list, `--optimizer.betas 0.9,0.95`
    eps: AdamW's epsilon
    weight_decay: on matrices only: not on norms, biases, embeddings, ELR step size or conditioning
    muon_momentum: `muon`: Nesterov momentum of the Muon matrices
    """

    name: str = "adamw"
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    muon_momentum: float = 0.95


@dataclass
class LRScheduler:
    """[lr_scheduler]: what each key means (the README table and --help are made from these lines).

    warmup_steps: linear warmup
    decay_type: `cosine` (to the minimum at the last step) or `wsd` (constant, then linear cool-down)
    decay_fraction: wsd: fraction of the steps in the final decay
    min_lr_ratio: final lr / peak lr
    """

    warmup_steps: int = 10
    decay_type: str = "cosine"
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.01


@dataclass
class Data:
    """[data]: what each key means (the README table and --help are made from these lines).

    path: folder with train.bin, val.bin, meta.json from scripts/prepare_data.py; a chat folder (`--format chat`,
        elr/chat_data.py) serves one conversation per row, its assistant tokens scored
    shuffle: permute windows each epoch (O(1)-memory bijection seeded by seed and epoch)
    task: a depth-bound task generated on the fly instead of token files: `pointer_chase` or `var_chain` (its own
        vocabulary, loss on the answer only, validation accuracy per difficulty at every k; data parallelism only)
    task_items: pairs (pointer_chase) or statements (var_chain) in each example's context
    task_max_difficulty: hops (pointer_chase) or binding depth (var_chain) drawn from 1..this
    task_curriculum_steps: updates over which the hardest difficulty drawn grows from 1 to the maximum in equal
        stages; 0: all from the start
    """

    path: str = "data/tinyprose"
    shuffle: bool = True
    task: str = ""
    task_items: int = 8
    task_max_difficulty: int = 6
    task_curriculum_steps: int = 0


@dataclass
class Tokenizer:
    """[tokenizer]: what each key means (the README table and --help are made from these lines).

    path: a tiktoken ranks file, or a tiktoken encoding name (`o200k_base`, ...); empty: the tokenizer recorded in
        `data.path`'s meta.json (looked up beside the data, then under the repository's `data/tokenizer/`)
    sha256: the ranks file's SHA-256 (64 hex digits), checked when set; empty: the trainer records the file's hash
        here in config.json (and in every checkpoint's), so inference refuses another tokenizer
    """

    path: str = ""
    sha256: str = ""


@dataclass
class Checkpoint:
    """[checkpoint]: what each key means (the README table and --help are made from these lines).

    enable: periodic saves and resume from the newest checkpoint
    folder: relative to `job.dump_folder`
    interval: steps between saves; the last step always saves
    keep_latest_k: committed checkpoints kept, counted up to the one just saved (never a newer one); 0 keeps all
    load_step: resume from this step (a rollback: newer checkpoints are moved aside as `step-M.abandoned-<time>`);
        -1: the newest usable one, if any
    async_save: write in the background (DCP async save) while training continues
    export_dtype: `none`, `float32` or `bfloat16`: at the end also write model weights only
    export_format: `dcp` (`step-N-model/`, this package's loaders) or `hf` (`step-N-hf/`: safetensors, config.json,
        tokenizer.json and remote code for transformers; needs `export_dtype`)
    create_seed: save the initial weights as step 0 and exit (one process)
    initial_load_path: start from another run's weights: a `step-N` folder, a checkpoint folder (its newest
        step) or a Hugging Face export (scripts/export_hf.py); model only, optimizer, schedule and data position fresh; ignored once this run has checkpoints of its
        own
    """

    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500
    keep_latest_k: int = 3
    load_step: int = -1
    async_save: bool = False
    export_dtype: str = "none"
    export_format: str = "dcp"
    create_seed: bool = False
    initial_load_path: str = ""


@dataclass
class Metrics:
    """[metrics]: what each key means (the README table and --help are made from these lines).

    log_freq: steps between console lines; the line's loss per k, mean k, gnorm, tok/s and MFU, and the per-loop
        statistics in metrics.jsonl, are over every step since the previous line
    enable_tensorboard: write TensorBoard scalars under `dump_folder/tb`
    peak_tflops: per-device peak TFLOP/s for MFU; 0: the device's dense bf16 peak when it is a GPU of the table in
        elr/train/metrics.py (H100, H200, A100, B200, MI300X, ...), else MFU is not reported (`mfu n/a`: on a CPU)
    enable_wandb: also log the scalars to Weights & Biases (`pip install -e ".[wandb]"`), into `dump_folder/wandb`,
        offline unless `WANDB_MODE` says otherwise; one run per dump folder, resumed with it
    """

    log_freq: int = 10
    enable_tensorboard: bool = True
    peak_tflops: float = 0.0
    enable_wandb: bool = False


@dataclass
class Validation:
    """[validation]: what each key means (the README table and --help are made from these lines).

    freq: steps between evaluations (also at step 0 and the last step); 0 disables
    steps: microbatches per evaluation, each run at every k
    """

    freq: int = 50
    steps: int = 4


@dataclass
class Parallelism:
    """[parallelism]: what each key means (the README table and --help are made from these lines).

    data_parallel_shard_degree: FSDP2 shards; -1: every rank not used by replication
    data_parallel_replicate_degree: HSDP replicas
    expert_parallel_degree: ranks per expert group, each owning E / ep whole experts of every MoE layer (MoE
        flavors; divides dp_shard and the expert count); 1: off
    context_parallel_degree: ranks that split each sequence into contiguous slices (cp × tp must divide
        `training.seq_len`); 1 = off
    tensor_parallel_degree: ranks that split every layer's heads / hidden dims, with the sequence split between
        layers (TP + SP); must divide the world size, the heads and `training.seq_len`
    """

    data_parallel_shard_degree: int = -1
    data_parallel_replicate_degree: int = 1
    expert_parallel_degree: int = 1
    context_parallel_degree: int = 1
    tensor_parallel_degree: int = 1


@dataclass
class Compile:
    """[compile]: what each key means (the README table and --help are made from these lines).

    enable: torch.compile each layer once; recurrent layers reuse their compiled code on every loop
    """

    enable: bool = False


@dataclass
class ActivationCheckpoint:
    """[activation_checkpoint]: what each key means (the README table and --help are made from these lines).

    mode: `none`, `selective` or `full` (recompute each layer call in backward, keep its input); every call of a
        recurrent layer is its own checkpoint
    selective_ac_option: selective: `op` (keep matmul and attention outputs, recompute the rest) or an integer N
        (fully checkpoint every N-th layer)
    """

    mode: str = "none"
    selective_ac_option: str = "op"


@dataclass
class Float8:
    """[float8]: what each key means (the README table and --help are made from these lines).

    enable: torchao float8 training for linear layers with dims divisible by 16 (not the head, router or ELR heads);
        emulated on CPU
    """

    enable: bool = False


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots (elr/train/profiling.py), as torchtitan's.

    enable_profiling: a torch.profiler trace (CPU, and CUDA kernels on a GPU) of one step every `profile_freq`
        steps, into `dump_folder/save_traces_folder/iteration_<step>/rank<r>_trace.json` (Perfetto, chrome://tracing)
    profile_freq: steps between traces and between memory snapshots (>= 2: warm-up steps precede each trace)
    save_traces_folder: relative to `job.dump_folder`
    enable_memory_snapshot: CUDA only (a warning elsewhere): record the allocator's history and dump a snapshot
        every `profile_freq` steps to `save_memory_snapshot_folder/iteration_<step>/rank<r>_memory_snapshot.pickle`
        (https://pytorch.org/memory_viz)
    save_memory_snapshot_folder: relative to `job.dump_folder`
    """

    enable_profiling: bool = False
    profile_freq: int = 10
    save_traces_folder: str = "profile_traces"
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"


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
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "elr.sampling": ("independent", "synchronized", "stratified"),
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
    file_data = dataclasses.replace(cfg.data)  # the data the config file names, for the dump folder's name
    for key, value in parse_overrides(overrides or [], is_flag=lambda key: key_type(cfg, key) is bool,
                                      check=lambda key: check_key(cfg, key)):
        set_key(cfg, key, value)
    if cfg.job.dump_folder and cfg.job.run_name:
        raise ConfigError("job.run_name: names the default dump folder, and job.dump_folder is set (set one of them)")
    if not cfg.job.dump_folder:
        cfg.job.dump_folder = default_dump_folder(cfg.job, cfg.data, path, file_data)
    resolve_bundled_paths(cfg)
    validate(cfg)
    return cfg


REPOSITORY = Path(__file__).resolve().parents[1]
BUNDLED_PATHS = ("data.path", "tokenizer.path")  # the shipped configs name files under data/


def resolve_bundled_paths(cfg: JobConfig, cwd: Path | None = None) -> None:
    """A relative data or tokenizer path that does not exist from the working directory but does
    under the repository (the bundled data/) is made absolute there, so `python /path/to/train.py`
    works from any directory. What exists from the working directory wins; config.json records the
    path that was used."""
    cwd = cwd or Path.cwd()
    for key in BUNDLED_PATHS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value and not Path(value).is_absolute() and not (cwd / value).exists() and (REPOSITORY / value).exists():
            setattr(getattr(cfg, section), name, str(REPOSITORY / value))


def config_from_dict(raw: dict) -> JobConfig:
    """A JobConfig from `JobConfig.to_dict()` output, e.g. a run's config.json; validated. The run's
    list of resume changes ("resumes", elr/train/resume.py) is history, not config: skipped."""
    cfg = JobConfig()
    apply_tables(cfg, {k: v for k, v in raw.items() if k != "resumes"})
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
    _check(e.emulated_ranks >= 1, "elr.emulated_ranks", "must be >= 1", e.emulated_ranks)
    _check(0.0 <= e.one_loop_override <= 1.0, "elr.one_loop_override", "must lie in [0, 1]", e.one_loop_override)
    if e.loop_weights:
        _check(len(e.loop_weights) == e.max_loops, "elr.loop_weights",
               f"needs one weight per k in 1..{e.max_loops}", e.loop_weights)
        _check(all(w >= 0 for w in e.loop_weights) and sum(e.loop_weights) > 0, "elr.loop_weights",
               "must be non-negative with a positive sum", e.loop_weights)
    _check(e.step_lr_scale > 0, "elr.step_lr_scale", "must be > 0", e.step_lr_scale)
    _check(e.step_weight_decay >= 0, "elr.step_weight_decay", "must be >= 0", e.step_weight_decay)
    _check(0.0 <= e.switch_at < 1.0, "elr.switch_at", "must lie in [0, 1)", e.switch_at)
    loops_conditioned = e.conditioning_first_loop or e.conditioning_later_loops
    _check(loops_conditioned or e.conditioning_exit, "elr.conditioning_later_loops",
           "and elr.conditioning_first_loop are both false and elr.conditioning_exit is off: nothing is conditioned "
           "(set elr.conditioning = false)", e.conditioning_later_loops)
    _check(e.conditioning or not e.conditioning_exit, "elr.conditioning_exit", "needs elr.conditioning = true",
           e.conditioning_exit)
    if e.loss_every_loop:
        _check(not (e.conditioning and e.conditioning_budget and loops_conditioned), "elr.loss_every_loop",
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
    _check(cfg.profiling.profile_freq >= 2, "profiling.profile_freq", "must be >= 2 (warm-up steps precede a trace)",
           cfg.profiling.profile_freq)
    for key in ("save_traces_folder", "save_memory_snapshot_folder"):
        _check(getattr(cfg.profiling, key) != "", f"profiling.{key}", "must name a folder", "")
    _check(cfg.metrics.peak_tflops >= 0, "metrics.peak_tflops", "must be >= 0 (0: the device's, if known)",
           cfg.metrics.peak_tflops)
    _check(not cfg.metrics.enable_wandb or importlib.util.find_spec("wandb") is not None, "metrics.enable_wandb",
           'needs wandb, an optional extra (pip install -e ".[wandb]")', cfg.metrics.enable_wandb)
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
