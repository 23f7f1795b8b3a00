"""The job's configuration as dataclass sections, one per TOML table: each key's type, default and
meaning (the comment above it) live here, on its field; elr/config/reference.py turns them into the
configuration page. Loading and checking live beside it (load.py, checks.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from elr.config.recurrence import RecurrenceOptions


@dataclass
class Job:
    """[job]: what each key means (the README table and --help are made from these lines).

    description: free text, saved with the run
    dump_folder: metrics.jsonl, TensorBoard (`tb/`), checkpoints and config.json go here; empty: `outputs/<run_name>`,
        or `outputs/<config file name>` plus `-<data folder>` (or `-<task>`) when the command line changes the data
        (elr/config/dump_folder.py); a folder holding a run is continued from its checkpoint (same model, tokenizer and data)
        or refused, never silently restarted
    run_name: names the default dump folder `outputs/<run_name>` (a second run of one config and data beside the
        first); empty: the config file's name; not with `dump_folder` set
    start_over: start a new run in a dump folder that holds one: its checkpoints, metrics.jsonl, config.json and `tb/`
        are set aside as `<name>.abandoned-<time>` (never deleted)
    """

    description: str = ""
    dump_folder: str = ""
    run_name: str = ""
    start_over: bool = False


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
class ELR(RecurrenceOptions):
    """[elr]: what each key means (the README table and --help are made from these lines).

    The recurrence's own options (max_loops, update, conditioning, ...) are the fields of
    elr/config/recurrence.py's RecurrenceOptions, documented there; these are the keys of the training.

    enabled: false: the non-recurrent baseline (every layer once, no ELR parameters; needs `max_loops = 1` and
        `conditioning = false`; the other recurrence options do not apply)
    partition: `[L_in, L_rec, L_out]`, must add up to the flavor's layer count; empty: the flavor's
    step_lr_scale: the step's parameters train at `optimizer.lr` × this (their own optimizer group)
    step_weight_decay: weight decay of the step's parameters (pulls W towards 0, the step towards 1)
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
    loop_weights_start: a loop-count schedule: the weights of the first mixed-depth update (K non-negative numbers,
        e.g. `[0, 0, 0, 1]`: loops first), blended linearly into `loop_weights` over `loop_schedule_steps`
        updates; empty: no schedule
    loop_schedule_steps: updates over which `loop_weights_start` becomes `loop_weights`, counted from the first
        mixed-depth update (after the late switch, if any); 0 with an empty `loop_weights_start`
    switch_at: fraction of `training.steps` trained at k=1 before mixed depth; needs checkpoints
    switch_conditioning: `at_switch` (the paper's: the one-loop phase has no conditioning, the switch adds it
        zero-initialised) or `from_start` (the conditioning exists and trains through the one-loop phase, at k = 1
        seeing E_budget[1]; the switch changes only the loop counts). Without a switch both build the same model;
        a run continued from a `from_start` checkpoint with `switch_at = 0` keeps `from_start` (frozen on resume)
    """

    enabled: bool = True
    partition: list[int] = field(default_factory=list)
    step_lr_scale: float = 1.0
    step_weight_decay: float = 0.0
    loss_every_loop: bool = False
    sampling: str = "independent"
    emulated_ranks: int = 1
    one_loop_override: float = 0.0
    loop_weights: list[float] = field(default_factory=list)
    loop_weights_start: list[float] = field(default_factory=list)
    loop_schedule_steps: int = 0
    switch_at: float = 0.0
    switch_conditioning: str = "at_switch"


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
        elr/text/chat_data.py) serves one conversation per row, its assistant tokens scored
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
