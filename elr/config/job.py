"""The job's configuration as dataclass sections, one per TOML table: each key's type, default and
meaning (the string under it) live here, on its field, and each section's rules in its `check()` beside
it (one error naming the key); a key with a fixed set of values is a `Literal[...]`, its one list of
choices. elr/config/reference.py turns the fields into the configuration page; the rules that tie two
sections together are in checks.py, loading in load.py."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from elr.config.data import Data
from elr.config.keys import check_fields, check_sha256, require
from elr.config.recurrence import RecurrenceOptions
from elr.config.rl import RL


@dataclass
class Job:
    """[job]: each key's meaning is the string under its field."""

    description: str = ""
    """free text, saved with the run"""
    dump_folder: str = ""
    """metrics.jsonl, TensorBoard (`tb/`), checkpoints and config.json go here; empty: `outputs/<run_name>`, or
    `outputs/<config file name>` plus `-<data folder>` (or `-<task>`) when the command line changes the data
    (elr/config/dump_folder.py); a folder holding a run is continued from its checkpoint (same model, tokenizer
    and data) or refused, never silently restarted"""
    run_name: str = ""
    """names the default dump folder `outputs/<run_name>` (a second run of one config and data beside the first);
    empty: the config file's name; not with `dump_folder` set"""
    start_over: bool = False
    """start a new run in a dump folder that holds one: its checkpoints, metrics.jsonl, config.json and `tb/` are
    set aside as `<name>.abandoned-<time>` (never deleted)"""

    def check(self) -> None:
        check_fields(self, "job")  # run_name and dump_folder: checked as the dump folder is named (load.py)


@dataclass
class Model:
    """[model]: each key's meaning is the string under its field."""

    flavor: str = "debug"
    """a flavor of elr/models/args.py (docs/models.md: `debug`, `gpt_0p5b`, `gdp_hybrid_4b`, ...)"""
    gdp_impl: Literal["auto", "triton", "chunk", "naive"] = "auto"
    """the Gated DeltaProduct op's implementation: `auto` (`triton` on CUDA, `chunk` elsewhere), `triton`,
    `chunk` or `naive` (the oracle); decoding one token at a time takes the one-token step of the same choice
    (`chunk` and `naive`: the token loop)"""

    def check(self) -> None:
        check_fields(self, "model")  # the flavor: against the model code's table (elr/models/from_config.py)


@dataclass
class ELR(RecurrenceOptions):
    """[elr]: each key's meaning is the string under its field.

    The recurrence's own options (max_loops, update, conditioning, ...) are the fields of
    elr/config/recurrence.py's RecurrenceOptions, documented there; these are the keys of the training.
    """

    enabled: bool = True
    """false: the non-recurrent baseline (every layer once, no ELR parameters; needs `max_loops = 1` and
    `conditioning = false`; the other recurrence options do not apply)"""
    partition: list[int] = field(default_factory=list)
    """`[L_in, L_rec, L_out]`, must add up to the flavor's layer count; empty: the flavor's"""
    step_lr_scale: float = 1.0
    """the step's parameters train at `optimizer.lr` × this (their own optimizer group)"""
    step_weight_decay: float = 0.0
    """weight decay of the step's parameters (pulls W towards 0, the step towards 1)"""
    loop_gate_lr_scale: float = 1.0
    """`identity_loops`' gates train at `optimizer.lr` × this, undecayed (their own optimizer group): a short run
    can let them open as far as a long one would"""
    loop_fade_steps: int = 0
    """`identity_loops`: the loops past the first fade in over this many updates after the late switch (from the
    first update without one): each gate is its learned value plus a ramp from 0 to 1, so the model ends as one
    whose loops are fully open, having started as the one-loop model; 0: the gates are learned alone"""
    loss_every_loop: bool = False
    """the loss at the exit of every loop 1..k of a slot (their mean), not k's alone; needs `conditioning_budget
    = false` or no conditioning"""
    sampling: Literal["independent", "synchronized", "stratified"] = "independent"
    """`independent` (each slot draws k), `synchronized` (one k per update) or `stratified` (one k per microbatch
    shared by every data-parallel rank, the microbatches of an update spread over the distribution; no rank waits
    for another's loops)"""
    emulated_ranks: int = 1
    """one process only: draw loop counts as this many data-parallel ranks would, its microbatches laid out ranks
    x microbatches (studies that stand in for a cluster); 1: the process is one rank"""
    one_loop_override: float = 0.0
    """fraction f in [0, 1] of data-parallel ranks that run k=1 on every microbatch (rotating over ranks; over
    whole expert groups under expert parallelism; over microbatch slots when one group spans every rank, or in
    one process)"""
    loop_weights: list[float] = field(default_factory=list)
    """K non-negative weights over k = 1..K; empty: uniform"""
    loop_weights_start: list[float] = field(default_factory=list)
    """a loop-count schedule: the weights of the first mixed-depth update (K non-negative numbers, e.g. `[0, 0,
    0, 1]`: loops first), blended linearly into `loop_weights` over `loop_schedule_steps` updates; empty: no
    schedule"""
    loop_schedule_steps: int = 0
    """updates over which `loop_weights_start` becomes `loop_weights`, counted from the first mixed-depth update
    (after the late switch, if any); 0 with an empty `loop_weights_start`"""
    switch_at: float = 0.0
    """fraction of `training.steps` trained at k=1 before mixed depth; needs checkpoints"""
    stop_at_switch: bool = False
    """the job saves at the late switch and exits (code 0), so the mixed-depth phase can start with other settings
    (more nodes, say): the same command then resumes at the switch; false: it runs on"""
    switch_conditioning: Literal["at_switch", "from_start"] = "at_switch"
    """`at_switch` (the paper's: the one-loop phase has no conditioning, the switch adds it zero-initialised) or
    `from_start` (the conditioning exists and trains through the one-loop phase, at k = 1 seeing E_budget[1]; the
    switch changes only the loop counts). Without a switch both build the same model; a run continued from a
    `from_start` checkpoint with `switch_at = 0` keeps `from_start` (frozen on resume)"""
    switch_warmup_steps: int = 0
    """the learning rate re-warms after the late switch: over this many updates from the first mixed-depth one, every
    group's scheduled lr is scaled from 1 / (n + 1) up to 1 (re-warming, arXiv 2403.08763), so the new loops' first
    large gradients meet a small step; 0: none"""
    switch_heal_steps: int = 0
    """a healing window after the late switch: for this many updates every parameter that k = 1 uses trains at its
    scheduled lr × `switch_heal_lr_scale` (0: frozen), and only the later loops' own parameters (`identity_loops`'
    gates, `loop_delta_rank`'s deltas) at the full lr; then everything trains (retrofitted recurrence, arXiv
    2511.07384). Needs a switch and one of those two; 0: none"""
    switch_heal_lr_scale: float = 0.0
    """the lr factor, in [0, 1], of the parameters k = 1 uses during `switch_heal_steps` (0: frozen; AdamW's moments
    still take their gradients, weight decay is scaled alike)"""
    k1_anchor: float = 0.0
    """weight λ of a k = 1 anchor after the late switch: on the microbatches that run one loop the loss gains λ(t) ×
    KL(switch-point model ‖ model) per token, the teacher being a frozen copy of the model as the switch left it,
    λ(t) decaying linearly to 0 over `k1_anchor_steps` updates; 0: none. The teacher is a whole replica on every
    rank (no FSDP, so it never communicates) kept in the checkpoints; needs a switch, the whole-logits loss
    (`training.loss_chunk_tokens = 0`) and no tensor, context or expert parallelism"""
    k1_anchor_steps: int = 0
    """updates after the late switch over which `k1_anchor`'s weight decays linearly to 0; 0: the whole mixed-depth
    phase"""
    loop_consistency: float = 0.0
    """weight λ of deeper loops teaching shallower ones (LoopFormer's consistency, arXiv 2602.11451): on a microbatch
    at k >= 2 the output block also reads the state after each loop i < k of the same forward (with budget i's
    exit FiLM) and the loss gains λ × the mean over i of KL(p_k ‖ p_i) per token, p_k detached; one forward, so
    every rank calls each FSDP unit once whatever its k. With the budget embedding in the loops exit i is loop i of
    a k-loop forward, not the model at budget i. Needs the whole-logits loss (`training.loss_chunk_tokens = 0`),
    no tensor parallelism and not `loss_every_loop`; 0: none"""

    def check(self) -> None:
        """The recurrence's options (RecurrenceOptions.check), then the training's; the late switch against
        training.steps and the checkpoints it goes through: elr/config/checks.py."""
        super().check()
        if self.partition:
            require(
                len(self.partition) == 3 and all(n >= 0 for n in self.partition),
                "elr.partition",
                "must be three non-negative layer counts [L_in, L_rec, L_out]",
                self.partition,
            )
            require(
                self.partition[1] >= 1, "elr.partition", "the recurrent block needs at least one layer", self.partition
            )
        require(self.emulated_ranks >= 1, "elr.emulated_ranks", "must be >= 1", self.emulated_ranks)
        require(
            0.0 <= self.one_loop_override <= 1.0, "elr.one_loop_override", "must lie in [0, 1]", self.one_loop_override
        )
        for key in ("loop_weights", "loop_weights_start"):
            if getattr(self, key):
                check_loop_weights(f"elr.{key}", getattr(self, key), self.max_loops)
        require(self.loop_schedule_steps >= 0, "elr.loop_schedule_steps", "must be >= 0", self.loop_schedule_steps)
        require(
            bool(self.loop_weights_start) == (self.loop_schedule_steps > 0),
            "elr.loop_schedule_steps",
            "and elr.loop_weights_start go together: a schedule needs both (or neither)",
            self.loop_schedule_steps,
        )
        require(self.step_lr_scale > 0, "elr.step_lr_scale", "must be > 0", self.step_lr_scale)
        require(self.step_weight_decay >= 0, "elr.step_weight_decay", "must be >= 0", self.step_weight_decay)
        require(self.loop_gate_lr_scale > 0, "elr.loop_gate_lr_scale", "must be > 0", self.loop_gate_lr_scale)
        require(self.loop_fade_steps >= 0, "elr.loop_fade_steps", "must be >= 0 (0: no fade)", self.loop_fade_steps)
        require(
            self.identity_loops or not self.loop_fade_steps,
            "elr.loop_fade_steps",
            "needs elr.identity_loops = true (the fade opens its gates)",
            self.loop_fade_steps,
        )
        require(0.0 <= self.switch_at < 1.0, "elr.switch_at", "must lie in [0, 1)", self.switch_at)
        require(
            self.loop_gate == "added" or self.loop_fade_steps > 0,
            "elr.loop_gate",
            "scaled needs elr.loop_fade_steps > 0 (each gate is the fade times its learned part: no fade, no loop)",
            self.loop_gate,
        )
        self._check_switch_designs()
        require(
            self.prefix_consistent or not self.loss_every_loop,
            "elr.loss_every_loop",
            "needs elr.conditioning_budget = false (with the budget embedding loop i of a k-loop run is "
            "not the model at budget i)",
            self.loss_every_loop,
        )
        require(
            self.switch_at > 0 or not self.stop_at_switch,
            "elr.stop_at_switch",
            "needs a late switch (elr.switch_at > 0)",
            self.stop_at_switch,
        )
        require(
            self.conditioning or self.switch_conditioning == "at_switch",
            "elr.switch_conditioning",
            "from_start needs elr.conditioning = true",
            self.switch_conditioning,
        )
        if not self.enabled:
            require(
                self.max_loops == 1,
                "elr.max_loops",
                "must be 1 when elr.enabled = false (the baseline)",
                self.max_loops,
            )
            require(not self.conditioning, "elr.conditioning", "needs elr.enabled = true", self.conditioning)
            require(self.switch_at == 0.0, "elr.switch_at", "needs elr.enabled = true", self.switch_at)

    def _check_switch_designs(self) -> None:
        """The late switch's lr windows and extra objectives: in range, and each with what it acts on."""
        for key in ("switch_warmup_steps", "switch_heal_steps", "k1_anchor_steps"):
            require(getattr(self, key) >= 0, f"elr.{key}", "must be >= 0 (0: none)", getattr(self, key))
        for key in ("k1_anchor", "loop_consistency"):
            require(getattr(self, key) >= 0, f"elr.{key}", "must be >= 0 (0: off)", getattr(self, key))
        require(
            0 <= self.switch_heal_lr_scale <= 1,
            "elr.switch_heal_lr_scale",
            "must lie in [0, 1]",
            self.switch_heal_lr_scale,
        )
        for key in ("switch_warmup_steps", "switch_heal_steps", "k1_anchor"):
            require(
                self.switch_at > 0 or not getattr(self, key),
                f"elr.{key}",
                "needs a late switch (elr.switch_at > 0)",
                getattr(self, key),
            )
        require(
            self.k1_anchor > 0 or not self.k1_anchor_steps,
            "elr.k1_anchor_steps",
            "needs elr.k1_anchor > 0",
            self.k1_anchor_steps,
        )
        require(
            not self.switch_heal_steps or self.identity_loops or self.loop_delta_rank > 0,
            "elr.switch_heal_steps",
            "needs parameters of the later loops' own to train (elr.identity_loops or elr.loop_delta_rank > 0)",
            self.switch_heal_steps,
        )
        require(
            not (self.loop_consistency and self.loss_every_loop),
            "elr.loop_consistency",
            "and elr.loss_every_loop both score the loops' exits: choose one",
            self.loop_consistency,
        )


def check_loop_weights(key: str, weights: list[float], max_loops: int) -> None:
    """A distribution over k = 1..K: one weight per k, non-negative with a positive sum. The one check of it:
    the [elr] section runs it, and so does the loop sampler on the weights it is given (elr/train/loop_sampler.py)."""
    require(len(weights) == max_loops, key, f"needs one weight per k in 1..{max_loops}", weights)
    require(all(w >= 0 for w in weights) and sum(weights) > 0, key, "must be non-negative with a positive sum", weights)


@dataclass
class MoE:
    """[moe]: each key's meaning is the string under its field."""

    route_replay: bool = False
    """recurrent MoE layers reuse loop-1 routes on later loops"""
    bias_update_rate: float = 1e-3
    """aux-loss-free balancing: expert-bias step per optimizer update"""
    aux_loss_coeff: float = 0.0
    """weight of the sequence-level balance loss (DeepSeek-V3 form, our choice), summed over routing calls; under
    route replay loop 1 only; 0 disables"""

    def check(self) -> None:
        check_fields(self, "moe")
        require(self.bias_update_rate >= 0, "moe.bias_update_rate", "must be >= 0", self.bias_update_rate)
        require(self.aux_loss_coeff >= 0, "moe.aux_loss_coeff", "must be >= 0", self.aux_loss_coeff)


@dataclass
class Training:
    """[training]: each key's meaning is the string under its field."""

    steps: int = 100
    """optimizer updates"""
    seq_len: int = 256
    """tokens per sequence"""
    local_batch_size: int = 8
    """sequences per microbatch (one slot)"""
    global_batch_size: int = -1
    """sequences per update; a multiple of local × data-parallel ranks (the rest is gradient accumulation); -1:
    local × ranks"""
    max_norm: float = 1.0
    """gradient-norm clipping; 0 disables"""
    seed: int = 0
    """initialisation, data order and loop draws"""
    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """`float32` or `bfloat16`: parameter dtype in compute under FSDP (gradients reduce in fp32)"""
    max_nonfinite_steps: int = 3
    """consecutive NaN/Inf updates skipped before the run stops"""
    loss_chunk_tokens: int = 0
    """> 0: cross entropy from the final hidden states this many tokens at a time, each chunk's logits recomputed
    in backward (`elr/train/loss.py`), so only one chunk's logits are ever alive (under TP, vocab-parallel: each
    rank's [chunk, vocab / tp] share); 0: the whole microbatch's logits at once"""

    def check(self) -> None:
        check_fields(self, "training")
        require(self.steps >= 1, "training.steps", "must be >= 1", self.steps)
        require(self.seq_len >= 1, "training.seq_len", "must be >= 1", self.seq_len)
        require(self.local_batch_size >= 1, "training.local_batch_size", "must be >= 1", self.local_batch_size)
        require(
            self.global_batch_size == -1 or self.global_batch_size >= 1,
            "training.global_batch_size",
            "must be -1 or >= 1",
            self.global_batch_size,
        )
        require(self.max_norm >= 0, "training.max_norm", "must be >= 0", self.max_norm)
        require(self.max_nonfinite_steps >= 0, "training.max_nonfinite_steps", "must be >= 0", self.max_nonfinite_steps)
        require(
            self.loss_chunk_tokens >= 0, "training.loss_chunk_tokens", "must be >= 0 (0 = off)", self.loss_chunk_tokens
        )


@dataclass
class Optimizer:
    """[optimizer]: each key's meaning is the string under its field."""

    name: Literal["adamw", "muon"] = "adamw"
    """`adamw`, or `muon`: Muon for hidden matrices (each expert its own), AdamW for embeddings, head, norms,
    biases, gates (router, GDP decay/beta) and ELR heads"""
    lr: float = 3e-3
    """peak learning rate (Muon's is scaled per matrix by 0.2·sqrt(max(out, in)) to match AdamW's update RMS)"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's (beta1, beta2); on the command line a comma-separated list, `--optimizer.betas 0.9,0.95`"""
    eps: float = 1e-8
    """AdamW's epsilon"""
    weight_decay: float = 0.1
    """on matrices only: not on norms, biases, embeddings, ELR step size or conditioning"""
    muon_momentum: float = 0.95
    """`muon`: Nesterov momentum of the Muon matrices"""

    def check(self) -> None:
        check_fields(self, "optimizer")
        require(self.lr > 0, "optimizer.lr", "must be > 0", self.lr)
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            "must be two numbers in [0, 1)",
            self.betas,
        )
        require(self.eps > 0, "optimizer.eps", "must be > 0", self.eps)
        require(self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", self.weight_decay)
        require(0 <= self.muon_momentum < 1, "optimizer.muon_momentum", "must lie in [0, 1)", self.muon_momentum)


@dataclass
class LRScheduler:
    """[lr_scheduler]: each key's meaning is the string under its field."""

    warmup_steps: int = 10
    """linear warmup"""
    decay_type: Literal["cosine", "wsd"] = "cosine"
    """`cosine` (to the minimum at the last step) or `wsd` (constant, then linear cool-down)"""
    decay_fraction: float = 0.2
    """wsd: fraction of the steps in the final decay"""
    min_lr_ratio: float = 0.01
    """final lr / peak lr"""

    def check(self) -> None:
        check_fields(self, "lr_scheduler")
        require(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", "must be >= 0", self.warmup_steps)
        require(0 < self.decay_fraction <= 1, "lr_scheduler.decay_fraction", "must lie in (0, 1]", self.decay_fraction)
        require(0 <= self.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio", "must lie in [0, 1]", self.min_lr_ratio)


@dataclass
class Tokenizer:
    """[tokenizer]: each key's meaning is the string under its field."""

    path: str = ""
    """a tiktoken ranks file, or a tiktoken encoding name (`o200k_base`, ...); empty: the tokenizer recorded in
    `data.path`'s meta.json (looked up beside the data, then under the repository's `data/tokenizer/`)"""
    sha256: str = ""
    """the ranks file's SHA-256 (64 hex digits), checked when set; empty: the trainer records the file's hash
    here in config.json (and in every checkpoint's), so inference refuses another tokenizer"""

    def check(self) -> None:
        check_fields(self, "tokenizer")
        check_sha256("tokenizer.sha256", self.sha256)


@dataclass
class Checkpoint:
    """[checkpoint]: each key's meaning is the string under its field."""

    enable: bool = False
    """periodic saves and resume from the newest checkpoint"""
    folder: str = "checkpoint"
    """relative to `job.dump_folder`"""
    interval: int = 500
    """steps between saves; the last step always saves"""
    keep_latest_k: int = 3
    """committed checkpoints kept, counted up to the one just saved (never a newer one); 0 keeps all"""
    load_step: int = -1
    """resume from this step (a rollback: newer checkpoints are moved aside as `step-M.abandoned-<time>`); -1:
    the newest usable one, if any"""
    async_save: bool = False
    """write in the background (DCP async save) while training continues"""
    export_dtype: Literal["none", "float32", "bfloat16"] = "none"
    """`none`, `float32` or `bfloat16`: at the end also write model weights only"""
    export_format: Literal["dcp", "hf"] = "dcp"
    """`dcp` (`step-N-model/`, this package's loaders) or `hf` (`step-N-hf/`: safetensors, config.json,
    tokenizer.json and remote code for transformers; needs `export_dtype`)"""
    create_seed: bool = False
    """save the initial weights as step 0 and exit (one process)"""
    initial_load_path: str = ""
    """start from another run's weights: a `step-N` folder, a checkpoint folder (its newest step) or a Hugging
    Face export (scripts/export_hf.py); model only, optimizer, schedule and data position fresh; ignored once
    this run has checkpoints of its own"""

    def check(self) -> None:
        check_fields(self, "checkpoint")
        require(self.interval >= 1, "checkpoint.interval", "must be >= 1", self.interval)
        require(self.keep_latest_k >= 0, "checkpoint.keep_latest_k", "must be >= 0", self.keep_latest_k)
        require(self.load_step >= -1, "checkpoint.load_step", "must be -1 (latest) or a step", self.load_step)
        require(
            self.enable or not self.create_seed,
            "checkpoint.create_seed",
            "needs checkpoint.enable = true",
            self.create_seed,
        )
        require(
            self.export_format == "dcp" or self.export_dtype != "none",
            "checkpoint.export_format",
            "writes an export only with checkpoint.export_dtype set (float32 or bfloat16)",
            self.export_format,
        )


@dataclass
class Metrics:
    """[metrics]: each key's meaning is the string under its field."""

    log_freq: int = 10
    """steps between console lines; the line's loss per k, mean k, gnorm, tok/s and MFU, and the per-loop
    statistics in metrics.jsonl, are over every step since the previous line"""
    enable_tensorboard: bool = True
    """write TensorBoard scalars under `dump_folder/tb`"""
    peak_tflops: float = 0.0
    """per-device peak TFLOP/s for MFU; 0: the device's dense bf16 peak when it is a GPU of the table in
    elr/train/metrics.py (H100, H200, A100, B200, MI300X, ...), else MFU is not reported (`mfu n/a`: on a CPU)"""
    enable_wandb: bool = False
    """also log the scalars to Weights & Biases (`pip install -e ".[wandb]"`), into `dump_folder/wandb`, offline
    unless `WANDB_MODE` says otherwise; one run per dump folder, resumed with it"""

    def check(self) -> None:
        check_fields(self, "metrics")
        require(self.log_freq >= 1, "metrics.log_freq", "must be >= 1", self.log_freq)
        require(
            self.peak_tflops >= 0, "metrics.peak_tflops", "must be >= 0 (0: the device's, if known)", self.peak_tflops
        )
        require(
            not self.enable_wandb or importlib.util.find_spec("wandb") is not None,
            "metrics.enable_wandb",
            'needs wandb, an optional extra (pip install -e ".[wandb]")',
            self.enable_wandb,
        )


@dataclass
class Validation:
    """[validation]: each key's meaning is the string under its field."""

    freq: int = 50
    """steps between evaluations (also at step 0 and the last step); 0 disables"""
    steps: int = 4
    """microbatches per evaluation, each run at every k"""

    def check(self) -> None:
        check_fields(self, "validation")
        require(self.freq >= 0, "validation.freq", "must be >= 0", self.freq)
        require(self.steps >= 1, "validation.steps", "must be >= 1", self.steps)


@dataclass
class Parallelism:
    """[parallelism]: each key's meaning is the string under its field."""

    data_parallel_shard_degree: int = -1
    """FSDP2 shards; -1: every rank not used by replication"""
    data_parallel_replicate_degree: int = 1
    """HSDP replicas"""
    expert_parallel_degree: int = 1
    """ranks per expert group, each owning E / ep whole experts of every MoE layer (MoE flavors; divides dp_shard
    and the expert count); 1: off"""
    context_parallel_degree: int = 1
    """ranks that split each sequence into contiguous slices (cp × tp must divide `training.seq_len`); 1 = off"""
    tensor_parallel_degree: int = 1
    """ranks that split every layer's heads / hidden dims, with the sequence split between layers (TP + SP); must
    divide the world size, the heads and `training.seq_len`"""

    def check(self) -> None:
        """The degrees alone; against training.seq_len: elr/config/checks.py; against the model's heads and
        experts: elr/models/from_config.py; against the world size: at launch (elr/parallel/parallel_dims.py)."""
        check_fields(self, "parallelism")
        require(
            self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
            "parallelism.data_parallel_shard_degree",
            "must be -1 or >= 1",
            self.data_parallel_shard_degree,
        )
        for key in (
            "data_parallel_replicate_degree",
            "expert_parallel_degree",
            "context_parallel_degree",
            "tensor_parallel_degree",
        ):
            require(getattr(self, key) >= 1, f"parallelism.{key}", "must be >= 1", getattr(self, key))


@dataclass
class Compile:
    """[compile]: each key's meaning is the string under its field."""

    enable: bool = False
    """torch.compile each layer once; recurrent layers reuse their compiled code on every loop"""

    def check(self) -> None:
        check_fields(self, "compile")


@dataclass
class ActivationCheckpoint:
    """[activation_checkpoint]: each key's meaning is the string under its field."""

    mode: Literal["none", "selective", "full"] = "none"
    """`none`, `selective` or `full` (recompute each layer call in backward, keep its input); every call of a
    recurrent layer is its own checkpoint"""
    selective_ac_option: str = "op"
    """selective: `op` (keep matmul and attention outputs, recompute the rest) or an integer N (fully checkpoint
    every N-th layer)"""

    def check(self) -> None:
        check_fields(self, "activation_checkpoint")
        option = self.selective_ac_option
        require(
            option == "op" or (option.isdigit() and int(option) >= 1),
            "activation_checkpoint.selective_ac_option",
            'must be "op" or a layer interval N >= 1',
            option,
        )


@dataclass
class Float8:
    """[float8]: each key's meaning is the string under its field."""

    enable: bool = False
    """torchao float8 training for linear layers with dims divisible by 16 (not the head, router or ELR heads);
    emulated on CPU"""

    def check(self) -> None:
        check_fields(self, "float8")


@dataclass
class Profiling:
    """[profiling]: each key's meaning is the string under its field.

    torchtitan-style torch.profiler traces and CUDA memory snapshots (elr/train/profiling.py).
    """

    enable_profiling: bool = False
    """a torch.profiler trace (CPU, and CUDA kernels on a GPU) of one step every `profile_freq` steps, into
    `dump_folder/save_traces_folder/iteration_<step>/rank<r>_trace.json` (Perfetto, chrome://tracing)"""
    profile_freq: int = 10
    """steps between traces and between memory snapshots (>= 2: warm-up steps precede each trace)"""
    save_traces_folder: str = "profile_traces"
    """relative to `job.dump_folder`"""
    enable_memory_snapshot: bool = False
    """CUDA only (a warning elsewhere): record the allocator's history and dump a snapshot every `profile_freq`
    steps to `save_memory_snapshot_folder/iteration_<step>/rank<r>_memory_snapshot.pickle`
    (https://pytorch.org/memory_viz)"""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """relative to `job.dump_folder`"""

    def check(self) -> None:
        check_fields(self, "profiling")
        require(
            self.profile_freq >= 2,
            "profiling.profile_freq",
            "must be >= 2 (warm-up steps precede a trace)",
            self.profile_freq,
        )
        for key in ("save_traces_folder", "save_memory_snapshot_folder"):
            require(getattr(self, key) != "", f"profiling.{key}", "must name a folder", "")


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
    rl: RL = field(default_factory=RL)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
