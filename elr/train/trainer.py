"""The training loop: mixed-depth gradient accumulation, the late switch, checkpoints, signals.

A token's path: data loader -> Trainer.train_step -> model(inputs, loops=k) -> cross entropy.
Each (data-parallel rank, microbatch) slot runs its own loop count k; the loss of an update is
the mean over all of its tokens, whatever depth produced them. The trainer puts the components
together: the loop counts and phases (elr/train/loop_sampler.py), validation (validate.py), the
gradient reductions across ranks (elr/parallel/gradients.py), checkpoints (checkpointer.py).

Past 450 lines because a run's whole life sits here, in the order it happens (claim the folders,
build and resume, the loop, the switch, save and export); what each step does is in train_step,
and every policy it applies lives in its own module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from elr.config import JobConfig
from elr.data.job_data import check_job_data, job_sources, job_tokenizer_path
from elr.data.loader import Batch, build_mixture_loader, build_task_loader, build_train_loader, job_task, microbatches
from elr.data.mixture import ORIGIN, continue_mixture, mixture_origin
from elr.errors import CheckpointError, ConfigError, RunWriteFailed
from elr.interop.hf_weights import check_installed
from elr.models import build_model as build_elr_model
from elr.models.from_config import check_model_config, model_args_from_config
from elr.parallel.context_parallel import shard_sequence
from elr.parallel.gradients import clip_gradients, reduce_gradients
from elr.parallel.parallel_dims import ParallelDims, init_distributed
from elr.parallel.parallelize import parallelize
from elr.text.tokenizer import build_tokenizer
from elr.train.checkpointer import CheckpointManager
from elr.train.initial_weights import load_weights_from
from elr.train.loop_sampler import DepthSchedule, wait_factor
from elr.train.loss import IGNORE_INDEX, model_loss
from elr.train.metrics import MetricsLogger, log_run_setup, outputs_line
from elr.train.nonfinite import NonFiniteGuard, check_weights_finite
from elr.train.optimizer import (
    SwitchLR,
    apply_job_settings,
    build_lr_scheduler,
    job_settings,
    update_expert_biases,
)
from elr.train.optimizer import build_optimizer as build_optimizer_from_config
from elr.train.profiling import Profiler
from elr.train.resume import RESUMES, change_line, check_resume, run_config
from elr.train.run_folder import claim_line, set_aside_run_files
from elr.train.run_lock import RunLock
from elr.train.step_report import StepReporter, StepStats
from elr.train.stop import StopOnSignal
from elr.train.stragglers import LoopTimer
from elr.train.switch_aids import SwitchObjectives
from elr.train.train_state import ModelState, OptimizerState
from elr.train.validate import Validator

logger = logging.getLogger("elr")


class Trainer:
    """The pretraining (and SFT) trainer. A training stage subclasses it through its public hooks, each named
    "Hook" in its docstring; in the order a run calls them: build_data, build_model, build_optimizer (and
    optimizer_updates), after_load, log_setup; build_reporter as train() starts; per step train_step (its
    batches, then forward_backward_step per microbatch), step_tokens, validate; states, state_dict and
    load_state_dict at saves and loads. The underscored methods are not extension points (a test holds every
    subclass in elr/ to that); docs/extending.md shows a stage in a dozen lines."""

    def __init__(self, cfg: JobConfig):
        check_model_config(cfg)  # the config checks that need the model code, before any work
        if cfg.checkpoint.export_format == "hf":
            check_installed('checkpoint.export_format = "hf"')
        self.cfg = cfg
        t = cfg.training
        self.rank, self.world_size, self.device = init_distributed()
        p = cfg.parallelism
        self.dims = ParallelDims(
            p.data_parallel_replicate_degree,
            p.data_parallel_shard_degree,
            self.world_size,
            ep=p.expert_parallel_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
        )
        self.dims.build_mesh(self.device.type)
        self.dp_rank, self.dp_world = self.dims.dp_rank, self.dims.dp_world

        self.global_batch, self.n_micro = microbatches(t, self.dp_world)

        self.dump_folder = Path(cfg.job.dump_folder)
        self.build_data()
        self.depths = DepthSchedule(cfg, self.dp_world, self.n_micro, group_size=self.dims.ep)
        checkpoint_folder = self.dump_folder / cfg.checkpoint.folder
        # The manager checks each step's hashes once (a collective); its config is the run's, set once the
        # resume's changes are known.
        self.checkpointer = CheckpointManager(
            checkpoint_folder,
            interval=cfg.checkpoint.interval,
            keep_latest_k=cfg.checkpoint.keep_latest_k,
            async_save=cfg.checkpoint.async_save,
        )
        # The step to resume from, and its changes, checked before anything is written: a frozen key
        # stops the job here.
        ckpt, self.planned_step = cfg.checkpoint, None
        if ckpt.enable and not cfg.job.start_over:
            self.planned_step = self.checkpointer.usable_step() if ckpt.load_step == -1 else ckpt.load_step
        self.resume_history, self.resume_changes = [], {}
        if self.planned_step is not None:
            self._check_resume(self.planned_step)
        self.checkpointer.config = run_config(cfg, self.resume_history)
        # refuses a run it would restart; `restart`: the earlier run's files go aside first
        folder_line, restart = claim_line(cfg, checkpoint_folder, self.planned_step)
        self.step = 0
        self.tokens_seen = 0
        self.nonfinite = NonFiniteGuard(t.max_nonfinite_steps)
        self.switch_objectives = SwitchObjectives.of(cfg)  # the k = 1 anchor, the loop consistency
        self.stop = StopOnSignal(self.device, saves=cfg.checkpoint.enable)

        # One run per folder, taken before anything is written: the dump folder, and the checkpoint
        # folder (which another run's checkpoint.folder may name) with checkpoints on.
        folders = {"job.dump_folder": self.dump_folder}
        if cfg.checkpoint.enable or cfg.job.start_over:
            folders["checkpoint.folder"] = checkpoint_folder
        self.lock = RunLock.acquire(folders, self.rank)
        try:
            if cfg.job.start_over:
                self.checkpointer.set_aside_after(-1)
            if restart and self.rank == 0:
                set_aside_run_files(self.dump_folder)
            if folder_line:
                logger.info(folder_line)
            self._build_and_resume()
            self.after_load()
            self.metrics = MetricsLogger(
                self.dump_folder,
                cfg.metrics.enable_tensorboard,
                self.rank,
                self.step,
                cfg.metrics.enable_wandb,
                cfg.to_dict(),
            )
            # A fresh run's config is what runs; a resume's changes are recorded once a step has run them.
            self.config_pending = self.step > 0
            if not self.config_pending:
                self._write_run_config()
            self.log_setup()
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise

    def build_data(self) -> None:
        """Hook, once in __init__ before the model: set `tokenizer` (or None), `vocab_size`, the training
        stream (`train_loader`, `data_iter`) and `validator`; here a token store (data.path), a mixture of them
        (data.sources, elr/data/mixture.py) or a task."""
        cfg, t = self.cfg, self.cfg.training
        self.task = job_task(cfg) if cfg.data.task else None
        self.tokenizer = None
        if self.task is not None:  # generated examples in the task's own vocabulary: no files, no tokenizer
            self.vocab_size = self.task.vocab_size
            self.train_loader = build_task_loader(
                self.task,
                t.local_batch_size,
                self.dp_rank,
                self.dp_world,
                t.seed,
                self.global_batch,
                cfg.data.task_curriculum_steps,
            )
        else:
            d = cfg.data
            cfg.tokenizer.path = job_tokenizer_path(cfg)  # config.json records the one used
            self.tokenizer = tokenizer = build_tokenizer(cfg.tokenizer.path)
            self.vocab_size = tokenizer.n_vocab
            check_job_data(cfg, tokenizer)
            build = build_mixture_loader if d.sources else build_train_loader
            self.train_loader = build(
                d.sources or d.path,
                t.seq_len,
                t.local_batch_size,
                self.dp_rank,
                self.dp_world,
                t.seed,
                d.shuffle,
                d.document_masking,
                self.vocab_size,
            )
        self.data_iter = iter(self.train_loader)
        self.validator = Validator(cfg, self.task, self.dp_rank, self.dp_world, self.device, self.vocab_size)

    # ---- setup -------------------------------------------------------------------------------

    def _check_resume(self, step: int) -> None:
        """Compare this job with the config checkpoint `step` was saved with (elr/train/resume.py): the
        run's resume history and this resume's changes."""
        saved = self.checkpointer.saved_config(step)  # read once every file of the step passed its hash check
        if saved is None:  # saved without a config (a conversion of one that had none): nothing to compare
            return
        self.resume_history = list(saved.get(RESUMES, []))
        self.resume_changes = check_resume(saved, self.cfg.to_dict(), step)
        if self.resume_changes:
            self.resume_history.append({"step": step, "changes": self.resume_changes})

    def _write_run_config(self) -> None:
        """config.json, atomically (a full disk leaves the previous one, never a torn one)."""
        if self.rank == 0:
            path = self.dump_folder / "config.json"
            tmp = path.with_name(f".config.json.{os.getpid()}")
            try:
                tmp.write_text(json.dumps(run_config(self.cfg, self.resume_history), indent=2))
                os.replace(tmp, path)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise RunWriteFailed(f"job.dump_folder: could not write {path} ({e.strerror or e})") from None

    def _build(self, mixed_depth: bool) -> None:
        """Model, optimizer and schedule for one phase: one loop (no conditioning) or mixed depth.

        Weights are initialised from the seed alone, so a model rebuilt at the switch gets the same
        fresh conditioning parameters as one built when resuming after it.
        """
        cfg = self.cfg
        self.mixed_depth = mixed_depth
        self.model_args = model_args_from_config(cfg, self.vocab_size, mixed_depth=mixed_depth)
        torch.manual_seed(cfg.training.seed)
        self.model = model = self.build_model()
        self.loop_timer = LoopTimer(model.recurrent, self.device)  # per-rank loop time: who waits for whom
        if self.switch_objectives is not None and self.switch_objectives.anchor and mixed_depth:
            self.switch_objectives.build_teacher(self.model_args, self.device)  # filled by a load or at the switch
        f1 = model.num_flops_per_token(cfg.training.seq_len, 1)
        self.fixed_cost = f1 / max(model.num_flops_per_token(cfg.training.seq_len, 2) - f1, 1) - 1
        self.optimizer, self.lr_scheduler = self.build_optimizer(model)

    def build_model(self) -> nn.Module:
        """Hook, at each phase's build (the seed just set) and whenever a subclass wants a copy (RL's frozen
        reference): a fresh model of `model_args`, parallelized, initialised, in train mode."""
        with torch.device("meta"):
            model = build_elr_model(self.model_args)
        parallelize(model, self.dims, self.cfg, self.device.type)
        model.to_empty(device=self.device)
        model.init_weights()
        return model.train()

    def build_optimizer(self, model: nn.Module) -> tuple[Optimizer, LRScheduler]:
        """Hook, after build_model at each phase's build: the optimizer and its LR schedule (over
        optimizer_updates() updates); a subclass may choose which parameters train, or how."""
        optimizer = build_optimizer_from_config(model, self.cfg.optimizer, self.cfg.elr)
        schedule = build_lr_scheduler(optimizer, self.cfg.lr_scheduler, self.optimizer_updates(), SwitchLR.of(self.cfg))
        return optimizer, schedule

    def optimizer_updates(self) -> int:
        """Hook, in build_optimizer: the optimizer updates of the whole run, the schedule's length (one per
        step here; a subclass that updates several times a step says so)."""
        return self.cfg.training.steps

    def after_load(self) -> None:
        """Hook, once in __init__ after the model is built and its weights loaded (a checkpoint,
        checkpoint.initial_load_path, or fresh): build what needs those weights. Nothing here."""

    def _build_and_resume(self) -> None:
        """Build the phase the checkpoint to resume from belongs to, then load it.

        If the newest checkpoint is unreadable the load falls back to an older one, which may sit on
        the other side of the switch; then the model is rebuilt for that phase and loaded again.
        """
        ckpt, planned = self.cfg.checkpoint, self.planned_step
        self._build(mixed_depth=self.depths.mixed_depth(planned or 0))
        # None only when the folder holds no checkpoint at all; one that none can be loaded from stops here
        loaded = self._load(None if ckpt.load_step == -1 else ckpt.load_step) if ckpt.enable else None
        if loaded is None:
            if ckpt.initial_load_path:
                self.load_initial_weights(ckpt.initial_load_path)
            return
        if loaded != planned:  # fell back past unusable checkpoints: compare with the one loaded
            self._check_resume(loaded)
            self.checkpointer.config = run_config(self.cfg, self.resume_history)
        self._continue_mixture()
        if self.resume_changes:
            logger.info(change_line(self.resume_changes, loaded))
        if self.depths.mixed_depth(self.step) != self.mixed_depth:
            self._enter_phase(not self.mixed_depth, self.step)

    def _continue_mixture(self) -> None:
        """After a load: a mixture that a resume changed (this one or an earlier one) starts where it was
        changed, each source after the samples it had served (elr/data/mixture.py); this resume's change is
        recorded in its history entry, which config.json and every later checkpoint keep."""
        dataset = getattr(getattr(self, "train_loader", None), "dataset", None)  # RL stages have no loader
        if not hasattr(dataset, "set_origin"):  # a task or conversations: no mixture
            return
        if "data.sources" in self.resume_changes:
            old = self.resume_changes["data.sources"][0] or [asdict(job_sources(replace(self.cfg.data, sources=[]))[0])]
            self.resume_history[-1][ORIGIN] = continue_mixture(old, self.resume_history[:-1], dataset.position)
        start, consumed = mixture_origin(self.resume_history, [s.name for s in job_sources(self.cfg.data)])
        if start or any(consumed):
            dataset.set_origin(start, consumed)

    def _enter_phase(self, mixed_depth: bool, step: int) -> None:
        """Rebuild for the phase and load `step` into it, unless both phases are one model (no
        conditioning, or `elr.switch_conditioning = "from_start"`): then only the loop counts change."""
        one_model = model_args_from_config(self.cfg, self.vocab_size, mixed_depth=mixed_depth) == self.model_args
        if one_model:
            self.mixed_depth = mixed_depth
            self._teacher_at_switch(step)
            return
        self._build(mixed_depth=mixed_depth)
        if step:
            self._load(step)

    def _teacher_at_switch(self, step: int) -> None:
        """The k = 1 anchor's teacher (elr.k1_anchor) becomes the model as it is now, once the mixed-depth phase
        starts at or before the switch step: after that it only ever comes from the checkpoints."""
        objectives = self.switch_objectives
        if objectives is None or not objectives.anchor or not self.mixed_depth or step > self.depths.switch_step:
            return
        if objectives.teacher is None:
            objectives.build_teacher(self.model_args, self.device)
        objectives.copy_model(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True)))

    def states(self) -> dict:
        """Hook, at every save and load: what a checkpoint holds, by name (DCP Stateful objects); a subclass
        may add items (their names are then expected in every checkpoint it loads)."""
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "train_state": self,
        } | ({"k1_teacher": ModelState(self.teacher)} if self.teacher is not None else {})

    @property
    def teacher(self) -> nn.Module | None:
        """The k = 1 anchor's teacher (elr.k1_anchor) once the mixed-depth phase has one, else None."""
        return self.switch_objectives.teacher if self.switch_objectives is not None else None

    def state_dict(self) -> dict:
        """Hook, at every save: the trainer's own state in a checkpoint (JSON values or tensors); a subclass
        with other progress to keep (no data position, a counter of its own) changes it with load_state_dict."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data_position": self.train_loader.dataset.position,
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Hook, at every load: restore what state_dict saved."""
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.train_loader.dataset.position = int(state["data_position"])
        torch.set_rng_state(state["rng"])

    def _missing_before_switch(self):
        """The keys a checkpoint from before the late switch lacks and this phase's model has: those of
        the conditioning parameters (weights and optimizer state), which keep their fresh values."""
        names = [name for name, role in self.model.parameter_roles().items() if role == "conditioning"]
        # the k = 1 anchor's teacher is saved from the first mixed-depth update on, so the switch checkpoint lacks it
        return lambda key: key.startswith("k1_teacher.") or any(f".{name}." in f".{key}." for name in names)

    def _load(self, step: int | None) -> int | None:
        """Resume from `step` (None: the newest usable), with this job's optimizer settings; newer
        checkpoints (a rollback, or unusable ones skipped) are moved aside, never resumed or pruned."""
        settings = job_settings(self.optimizer)
        loaded = self.checkpointer.load(self.states(), step=step, allow_missing=self._missing_before_switch())
        if loaded is not None:
            logger.info(f"resumed from {self.checkpointer.folder}/step-{loaded} (step {self.step})")
            self.checkpointer.set_aside_after(loaded)
            apply_job_settings(self.optimizer, self.lr_scheduler, settings)  # logged as config changes
            self._teacher_at_switch(loaded)
        return loaded

    def load_initial_weights(self, path: str, model: nn.Module | None = None) -> None:
        """Start from another run's weights (checkpoint.initial_load_path: a later stage of training);
        everything else is fresh. `model`: load them into that model instead (a subclass's frozen reference)."""
        model = model if model is not None else self.model
        allow_missing = self._missing_before_switch()
        load_weights_from(path, model, self.model_args, self.checkpointer, allow_missing, self.rank)

    def log_setup(self) -> None:
        """Hook, last in __init__: the lines a run prints before its first step (the model, the layout, the
        config's changes from the defaults); a subclass may say more about its stage."""
        log_run_setup(self.cfg, self.model, self.dims, self.device, self.n_micro, self.global_batch)
        if not self.mixed_depth:
            logger.info(f"one loop until step {self.depths.switch_step}, then mixed depth")

    # ---- training ----------------------------------------------------------------------------

    def train_step(self, step: int) -> StepStats:
        """Hook, once per step from train(): one optimizer update over every microbatch slot, each at its own
        loop count k, and the step's statistics; a subclass may replace the whole update (RL: rollouts first)."""
        cfg, K = self.cfg, self.model_args.recurrence.max_loops
        every_loop = cfg.elr.loss_every_loop and self.mixed_depth
        ks = self.depths.loop_counts(step)
        self.model.record_loop_statistics(True)  # every step: the console window covers every loop that ran
        batches = self.batches(step)
        # The update's loss is its mean over scored tokens (labels not ignored). FSDP averages gradients
        # over the world / tp ranks that hold different tokens, so each rank's summed loss is scaled by
        # (world / tp) / scored, with `scored` counted over all ranks (tp times over: TP ranks share
        # their tokens): world / that count. Without ignored labels it is 1 / this rank's tokens.
        scored = torch.stack([(b.labels != IGNORE_INDEX).sum() for b in batches]).sum().double()
        if dist.is_initialized():
            dist.all_reduce(scored)
        loss_scale = self.world_size / max(scored.item(), 1.0)
        # Row 0: summed loss per k, row 1: tokens per k (this rank), reduced over ranks below.
        per_k = torch.zeros(2, K, dtype=torch.float64, device=self.device)
        loop_stats: dict[str, list[torch.Tensor]] = {}  # kept on the device until the step ends
        aux_sum = torch.zeros((), device=self.device)  # balance loss summed over microbatches
        # Every TP rank of a data-parallel rank reads the same batches and runs the same k: ks is drawn
        # per data-parallel rank, the same on every process.
        self.loop_timer.active = True
        for batch, k in zip(batches, ks[self.dp_rank].tolist()):
            loss_sum, aux = self.forward_backward_step(*batch[:2], k, loss_scale, every_loop, batch.document_ids)
            if aux is not None:
                aux_sum += aux
            per_k[0, k - 1] += loss_sum.double()
            per_k[1, k - 1] += (batch.labels != IGNORE_INDEX).sum()
            for i, stats in enumerate(self.model.loop_statistics(), start=1):
                for name, value in stats.items():
                    loop_stats.setdefault(f"loop{i}/{name}", []).append(value)
        self.loop_timer.active = False
        if dist.is_initialized():
            dist.all_reduce(per_k)  # TP ranks count their (shared) sequences alike: the ratios hold
        loss = (per_k[0].sum() / per_k[1].sum()).item()
        reduce_gradients(self.model, self.dims)
        grad_norm = clip_gradients(self.model, cfg.training.max_norm)

        if self.nonfinite.allows_update(step, loss, grad_norm):
            self.optimizer.step()
            moe_stats = update_expert_biases(self.model.moe_layers(), cfg.moe.bias_update_rate)
        else:
            moe_stats = update_expert_biases(self.model.moe_layers(), 0.0)  # drop this update's counts
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()

        scalars = {
            "loss/train": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "loops/mean": ks.float().mean().item(),
            "loops/wait_expected": wait_factor(self.depths.by_rank(ks), self.fixed_cost),
            **self.train_loader.dataset.progress(),  # a mixture: each source's epochs so far
        }
        for k, (loss_sum, tokens) in enumerate(zip(*per_k.tolist()), start=1):
            if tokens > 0:
                scalars[f"loss/k{k}"] = loss_sum / tokens
        scalars.update(moe_stats)
        if self.switch_objectives is not None:
            scalars.update(self.switch_objectives.report(step))
        if self.model.moe_layers():  # logged whatever the coefficient (unscaled; 1 per routing call if balanced)
            if dist.is_initialized():
                dist.all_reduce(aux_sum)
            scalars["moe/aux_loss"] = (aux_sum / (self.n_micro * self.dp_world)).item()
        return StepStats(scalars, ks, per_k, loop_stats, every_loop)

    def batches(self, step: int) -> list[Batch]:
        """Hook, once per step in train_step: this rank's n_micro microbatches (Batch: inputs, labels and the
        document ids or None), on the device; a subclass may filter or change them (a label of IGNORE_INDEX is
        not scored)."""
        return [self._slice(next(self.data_iter)) for _ in range(self.n_micro)]

    def forward_backward_step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        k: int,
        loss_scale: float,
        every_loop: bool,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hook, per microbatch in train_step: the forward at k loops and the backward of loss_scale x its
        summed token loss (plus the MoE balance term); returns that summed loss and the balance loss,
        detached, for the step's report. A subclass may add terms to what is backpropagated."""
        with self._loss_context():
            objectives, step = self.switch_objectives, self.step + 1
            if objectives is not None and objectives.applies(step, k, self.mixed_depth):
                # the anchor, the consistency
                loss_sum, extra = objectives.loss(self.model, inputs, labels, k, step, document_ids)
                micro_loss = (loss_sum + extra) * loss_scale
            else:
                loss_sum = self.model_loss(inputs, labels, k, every_loop=every_loop, document_ids=document_ids)
                micro_loss = loss_sum * loss_scale
            # Under TP or CP: this rank's share of its sequences' balance loss. FSDP averages over the cp
            # ranks (the token loss is per rank) but the shares add up: hence x cp.
            aux = self.model.moe_aux_loss()
            coeff = self.cfg.moe.aux_loss_coeff
            if aux is not None and coeff > 0:  # each microbatch's term / n_micro: the update's mean
                micro_loss = micro_loss + coeff * aux * self.dims.cp / self.n_micro
            micro_loss.backward()
        return loss_sum.detach(), (aux.detach() if aux is not None else None)

    def _slice(self, batch: Batch) -> Batch:
        """On the device; under context parallelism, this rank's contiguous slice of each sequence and of its
        document ids (every CP rank of a data-parallel rank read the same sequences, so the ids agree)."""
        if self.dims.cp > 1:
            batch = Batch(*(x if x is None else shard_sequence(x, self.dims.cp_rank, self.dims.cp) for x in batch))
        return Batch(*(x if x is None else x.to(self.device) for x in batch))

    def _loss_context(self):
        """loss_parallel under TP (forward and backward of the loss on vocab-sharded logits)."""
        return loss_parallel() if self.dims.tp_mesh is not None else contextlib.nullcontext()

    def model_loss(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        k: int,
        every_loop: bool = False,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Summed cross entropy at k loops, as training.loss_chunk_tokens and the layout ask; document_ids
        (this rank's slice, as `_slice` gives it): documents packed into a row never see each other."""
        return model_loss(
            self.model,
            inputs,
            labels,
            k,
            self.cfg.training.loss_chunk_tokens,
            tensor_parallel=self.dims.tp_mesh is not None,
            every_loop=every_loop,
            document_ids=document_ids,
        )

    def validate(self) -> dict[str, float]:
        """Hook, every validation.freq steps (and at step 0 and the last): validation loss at every k in 1..K
        (on a task also answer accuracy), elr/train/validate.py; a subclass measures its own."""

        def loss(inputs, labels, k, document_ids=None):
            with self._loss_context():
                return self.model_loss(inputs, labels, k, document_ids=document_ids)

        return self.validator(self.model, self._slice, loss)

    def _switch_to_mixed_depth(self, step: int) -> None:
        """The late switch: save, rebuild with zero-initialised conditioning, reload, continue (or, with
        one model for both phases, only continue at mixed depth).

        Going through the checkpoint makes the in-run switch and a resume at the switch one path.
        """
        self._save(step)
        self.checkpointer.wait()
        self._enter_phase(True, step)
        r = self.model_args.recurrence
        how = "added at zero" if self.cfg.elr.switch_conditioning == "at_switch" else "trained since step 1"
        logger.info(
            f"step {step}: switched to mixed depth (K={r.max_loops}), loop conditioning "
            f"{how if r.conditioning else 'off'}"
        )

    def _states_to_save(self) -> dict:
        """The states a checkpoint holds, never weights holding NaN/Inf (every rank checks its shards)."""
        check_weights_finite(self.model, self.device, self.step)
        return self.states()

    def _save(self, step: int) -> None:
        self.checkpointer.save(step, self._states_to_save())

    def create_seed_checkpoint(self) -> None:
        """checkpoint.create_seed: save the initial weights as step-0 and train nothing (one process)."""
        if self.world_size > 1:
            raise ConfigError("checkpoint.create_seed: run it in one process (python train.py ...)")
        if self.step:
            raise ConfigError(f"checkpoint.create_seed: {self.checkpointer.folder} already holds step {self.step}")
        self._save(0)
        self.checkpointer.wait()
        logger.info(f"saved the initial weights to {self.checkpointer.folder}/step-0")

    def train(self) -> None:
        """The run: steps until training.steps (or a stop), validation, checkpoints, the switch, the export."""
        cfg, t = self.cfg, self.cfg.training
        if cfg.checkpoint.create_seed:
            return self.create_seed_checkpoint()
        reporter = self.build_reporter()
        profiler = Profiler(cfg.profiling, self.dump_folder, self.rank, self.device)
        try:
            with self.stop, profiler:
                if self.step == 0 and cfg.validation.freq:
                    self._log_validation(0)
                while self.step < t.steps:
                    step = self.step + 1
                    start = time.perf_counter()
                    if cfg.elr.loop_fade_steps:
                        self.model.set_loop_fade(self.depths.loop_fade(step, cfg.elr.loop_fade_steps))
                    stats = self.train_step(step)
                    seconds = time.perf_counter() - start
                    self.step, self.tokens_seen = step, self.tokens_seen + self.step_tokens(stats)
                    reporter.report(step, stats, seconds, self.model, self.tokens_seen)
                    if self.config_pending:  # the resumed step ran with this config: now config.json says so
                        self._write_run_config()
                        self.config_pending = False
                    profiler.step(step)
                    if cfg.validation.freq and (step % cfg.validation.freq == 0 or step == t.steps):
                        self._log_validation(step)

                    if self.metrics.failed:  # every rank stops after this step, with a checkpoint
                        self.stop.requested = True
                    stop = self.stop.now()
                    if step == self.depths.switch_step and step < t.steps:
                        self._switch_to_mixed_depth(step)
                        if cfg.elr.stop_at_switch:
                            logger.info(
                                f"stopped at the switch (step {step}, elr.stop_at_switch); the same command "
                                "resumes here in the mixed-depth phase"
                            )
                            break
                    elif cfg.checkpoint.enable:
                        self.checkpointer.maybe_save(step, step == t.steps, self._states_to_save, force=stop)
                    if stop:
                        if not self.metrics.failed:
                            logger.info(
                                f"stopped at step {step}; resume with the same command"
                                if cfg.checkpoint.enable
                                else f"stopped at step {step} without saving (checkpoint.enable is false)"
                            )
                        break
                self.checkpointer.wait()
                if self.metrics.failed:
                    kept = (
                        f"saved checkpoint step-{self.step} in {self.checkpointer.folder}; the same command resumes "
                        "there once the folder can be written"
                        if cfg.checkpoint.enable
                        else f"stopped at step {self.step} without a checkpoint (checkpoint.enable is false)"
                    )
                    raise RunWriteFailed(f"metrics: {self.metrics.failed}; {kept}")
                export = None
                if cfg.checkpoint.export_dtype != "none" and self.step == t.steps:
                    export = self._export()
                self._log_outputs(export)
        finally:
            self.metrics.close()

    def build_reporter(self) -> StepReporter:
        """Hook, once as train() starts: what turns each step's StepStats into metrics and console lines; a
        subclass with its own statistics brings its own reporter."""
        return StepReporter(
            self.cfg,
            self.metrics,
            self.world_size,
            self.device,
            self.global_batch * self.cfg.training.seq_len,
            lambda: self.loop_timer,
        )

    def step_tokens(self, stats: StepStats) -> int:
        """Hook, after each step: the tokens it trained on, added to tokens_seen (here every slot's whole
        sequence); a subclass whose batches vary in length counts its own."""
        return self.global_batch * self.cfg.training.seq_len

    def _export(self) -> Path:
        """The model weights alone, as checkpoint.export_dtype and export_format ask, after the last step.
        One that cannot be written (no space, no permission, a foreign folder in the way) leaves no partial
        export; the checkpoint just saved stays, and the same command writes the export (resume.py)."""
        c = self.cfg.checkpoint
        dtype = getattr(torch, c.export_dtype)
        try:
            if c.export_format == "hf":
                path = self.checkpointer.export_hf(self.step, self.model, self.model_args, self.tokenizer, dtype)
            else:
                path = self.checkpointer.export_model(self.step, self.model, dtype)
        except CheckpointError as e:
            kept = (
                f"checkpoint step-{self.step} in {self.checkpointer.folder} is kept; the same command writes the "
                "export once the folder can be written"
                if c.enable
                else "the trained weights are lost (checkpoint.enable is false)"
            )
            raise RunWriteFailed(f"{e}; {kept}") from None
        logger.info(f"exported model weights ({c.export_dtype}, {c.export_format}) to {path}")
        return path

    def _log_outputs(self, export: Path | None) -> None:
        """The run's closing line: where its metrics, curves and last checkpoint are."""
        latest = self.checkpointer.latest_step() if self.cfg.checkpoint.enable else None
        checkpoint = self.checkpointer.folder / f"step-{latest}" if latest is not None else None
        logger.info(
            outputs_line(
                self.dump_folder,
                self.step,
                self.cfg.training.steps,
                self.cfg.metrics.enable_tensorboard,
                checkpoint,
                export,
            )
        )

    def _log_validation(self, step: int) -> None:
        val = self.validate()
        self.metrics.log(step, val)
        logger.info(self.validator.summary(step, val))

    def close(self) -> None:
        """Release the run's lock and the process group; call it once train() returns or raises."""
        if self.lock is not None:
            self.lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
