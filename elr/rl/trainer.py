"""The RLVR stage's trainer: a Trainer whose step is a batch of rollouts and the updates on it.

A step, on every data-parallel rank for its share of the batch:
1. prompts and a loop count per group, drawn from (seed, step) alone (elr/rl/prompts.py, the `[elr]`
   sampler over groups): the same draws on any number of ranks, and after a resume;
2. G completions per prompt sampled at the group's k (elr/rl/rollout.py: `rl.rollout_kv`'s cache, each row's
   draws from (seed, step, row, position)), with the sampler's log-prob of every token; rewards; with
   `rl.dynamic_sampling_rounds`, groups without signal replaced by fresh ones;
3. advantages within each group (elr/rl/objective.py);
4. `rl.minibatches` x `rl.updates_per_batch` optimizer updates (elr/rl/update.py): per microbatch the log-probs
   recomputed by the training forward at each row's k and the sampling temperature, the clipped surrogate
   against the rollout policy (and the importance weights from the sampler where the cache is not exact, and
   KL), summed with the loss type's weights and divided by the update's denominator.
Everything else (checkpoints and exact resume, the console, metrics, signals, the run folder) is the
pretraining Trainer's; this class changes it only through the Trainer's public hooks.
"""

from __future__ import annotations

import json
import logging
import time

import torch
import torch.distributed as dist

from elr.errors import ConfigError
from elr.parallel.gradients import clip_gradients, reduce_gradients
from elr.rl.logprobs import token_logprobs
from elr.rl.objective import group_advantages, loss_denominator
from elr.rl.prompts import drawn, load_prompts, split
from elr.rl.report import RLEvaluator, RLReporter
from elr.rl.rewards import load_reward
from elr.rl.rollout import Rollouts, sample_groups, without_signal
from elr.rl.update import EXACT_CACHES, Micro, RatioStats, micro_loss, plan, ratio_and_weights
from elr.text.tokenizer import build_tokenizer
from elr.train.metrics import log_run_setup
from elr.train.step_report import StepStats
from elr.train.trainer import Trainer

logger = logging.getLogger("elr")


class RLTrainer(Trainer):
    """Trainer for `rl.enable = true` (train.py picks it)."""

    # ---- setup -------------------------------------------------------------------------------

    def build_data(self) -> None:
        """The tokenizer, the prompts (training and held out), the reward; checked before any work."""
        cfg, r = self.cfg, self.cfg.rl
        if not cfg.tokenizer.path:
            raise ConfigError(
                "tokenizer.path: the RLVR stage reads no data folder; name the tokenizer the SFT model was trained with"
            )
        self.task = None
        self.tokenizer = build_tokenizer(cfg.tokenizer.path)
        self.vocab_size = self.tokenizer.n_vocab
        self.prompts, held_out = split(load_prompts(r.prompts))
        self.eval_prompts = held_out[: r.eval_prompts]
        self.reward = load_reward(r.reward, r.answer_format)
        self.prompt_ids = [p.encode(self.tokenizer) for p in self.prompts]
        longest = max(len(ids) for ids in self.prompt_ids + [p.encode(self.tokenizer) for p in self.eval_prompts])
        if longest + r.max_new_tokens > cfg.training.seq_len:
            raise ConfigError(
                f"rl.max_new_tokens: the longest prompt ({longest} tokens) plus max_new_tokens = "
                f"{r.max_new_tokens} exceeds training.seq_len = {cfg.training.seq_len}"
            )
        self.n_groups = self.global_batch // r.group_size  # every rank's, together
        if self.n_groups % self.dp_world:
            raise ConfigError(
                f"training.global_batch_size: {self.global_batch} completions are {self.n_groups} groups "
                f"of {r.group_size}, which {self.dp_world} data-parallel ranks cannot share evenly"
            )
        groups = self.n_groups // self.dp_world
        if groups % r.minibatches or self.n_micro % r.minibatches:
            raise ConfigError(
                f"rl.minibatches: {r.minibatches} must divide each rank's {groups} groups and its {self.n_micro} "
                f"microbatches of training.local_batch_size = {cfg.training.local_batch_size} completions "
                "(a minibatch is whole groups, whole microbatches)"
            )
        if r.loop_credit != "last" and r.group_size % cfg.training.local_batch_size:
            raise ConfigError(
                f"training.local_batch_size: with rl.loop_credit = {r.loop_credit} a microbatch must hold one "
                f"group's completions (one k): {cfg.training.local_batch_size} must divide rl.group_size = "
                f"{r.group_size}"
            )
        if r.rollout_compile and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                "rl.rollout_compile: the compiled decode step runs an unsharded model in one process; "
                f"this run has {dist.get_world_size()} ranks (set it false)"
            )
        self.validator = RLEvaluator(self)

    def optimizer_updates(self) -> int:
        """`rl.minibatches` x `rl.updates_per_batch` updates per step."""
        return self.cfg.training.steps * self.cfg.rl.minibatches * self.cfg.rl.updates_per_batch

    def after_load(self) -> None:
        """With a KL term: the stage's initial model, frozen (built after the trained one is loaded)."""
        self.reference = None
        if self.cfg.rl.kl_coeff > 0:
            reference = self.build_model()
            self.load_initial_weights(self.cfg.checkpoint.initial_load_path, reference)
            self.reference = reference.eval().requires_grad_(False)

    def state_dict(self) -> dict:  # prompts and draws follow the step: no data position
        return {"step": self.step, "tokens_seen": self.tokens_seen, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        torch.set_rng_state(state["rng"])

    def log_setup(self) -> None:
        log_run_setup(self.cfg, self.model, self.dims, self.device, self.n_micro, self.global_batch)
        r, e = self.cfg.rl, self.cfg.elr
        logger.info(
            f"RLVR: {len(self.prompts)} training prompts, {len(self.eval_prompts)} held out | "
            f"{self.n_groups} prompts x {r.group_size} completions per step, one k per group drawn "
            f"{e.sampling} from weights {e.loop_weights or 'uniform'} over 1..{e.max_loops} | "
            f"loss {r.loss_type}, rewards scaled by {r.scale_rewards}, clip [{1 - r.clip_low:g}, "
            f"{1 + r.clip_high:g}], {r.minibatches} minibatch(es) x {r.updates_per_batch} pass(es) per batch, "
            f"loop credit {r.loop_credit}, reward {r.reward} | rollouts {r.rollout_kv} at temperature "
            f"{r.temperature:g}, top_p {r.top_p:g}: "
            + (
                "on-policy (exact cache)"
                if r.rollout_kv in EXACT_CACHES
                else f"{r.rollout_correction} importance weights, cap {r.rollout_correction_cap:g}"
            )
        )

    def build_reporter(self) -> RLReporter:
        return RLReporter(self.cfg, self.metrics, self.world_size, self.device)

    def step_tokens(self, stats: StepStats) -> int:
        """Prompt and completion tokens of the batch: rows vary in length."""
        return int(stats.scalars["rl/tokens"])

    # ---- a step ------------------------------------------------------------------------------

    def my_groups(self) -> range:
        per_rank = self.n_groups // self.dp_world
        return range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)

    def all_done(self):
        """The decode loop's stopping rule across ranks: every rank runs the same number of forwards."""
        if not dist.is_initialized():
            return None

        def combine(mine: bool) -> bool:
            flag = torch.tensor([0 if mine else 1], device=self.device)
            dist.all_reduce(flag)
            return int(flag) == 0

        return combine

    @torch.no_grad()
    def rollout(self, step: int) -> Rollouts:
        """This rank's groups of the step, sampled and scored; with dynamic sampling, the groups without signal
        replaced round by round (a fresh prompt at the group's own k, so the counts per k stay the sampler's)."""
        r, G = self.cfg.rl, self.cfg.rl.group_size
        groups = list(self.my_groups())
        ks = self.depths.sampler.sample(step, 1, self.n_groups)[0].tolist()

        def round_of(round_: int, places: list[int]) -> Rollouts:
            seed = self.cfg.training.seed + 7919 * round_  # each round its own order of the prompts
            chosen = drawn(len(self.prompts), seed, step, self.n_groups)
            return sample_groups(
                self,
                step,
                round_,
                places,
                [self.prompts[chosen[g]] for g in places],
                [self.prompt_ids[chosen[g]] for g in places],
                [ks[g] for g in places],
            )

        batch = round_of(0, groups)
        self.refilled = 0
        for round_ in range(1, r.dynamic_sampling_rounds + 1):
            empty = without_signal(batch.rewards, G)
            most = torch.tensor([len(empty)], device=self.device)
            if dist.is_initialized():
                dist.all_reduce(most, op=dist.ReduceOp.MAX)  # every rank decodes as many groups (FSDP)
            if int(most) == 0:
                break
            places = [groups[i] for i in empty]
            fresh = round_of(round_, places + [groups[0]] * (int(most) - len(places)))
            for n, i in enumerate(empty):
                batch.replace_group(i, fresh, n, G)
            self.refilled += len(empty)
        return batch

    def train_step(self, step: int) -> StepStats:
        cfg, r = self.cfg, self.cfg.rl
        start = time.perf_counter()
        batch = self.rollout(step)
        rollout_seconds = time.perf_counter() - start
        if r.samples_every and step % r.samples_every == 0:
            self.write_samples(step, batch)

        rewards = torch.tensor(batch.rewards, dtype=torch.float64).view(-1, r.group_size)
        advantages = group_advantages(rewards, scale_by_std=r.scale_rewards == "group").flatten().float()
        minibatches = plan(batch, advantages.to(self.device), cfg, self.tokenizer.eot_id, self.vocab_size, self.device)
        # Each update's scored tokens and completions, over every rank: its loss's denominator.
        counts = torch.tensor(
            [
                [float(sum(m.mask.sum() for m in micros)), float(sum(len(m.rows) for m in micros))]
                for micros in minibatches
            ],
            dtype=torch.float64,
            device=self.device,
        )
        if dist.is_initialized():
            dist.all_reduce(counts)
        denominators = [loss_denominator(r.loss_type, tokens, n, r.max_new_tokens) for tokens, n in counts.tolist()]
        scored = counts[:, 0].sum().item()

        exact = r.rollout_kv in EXACT_CACHES
        credit = r.loop_credit != "last"
        passes = r.minibatches * r.updates_per_batch
        # The ratio's reference, the rollout policy: the sampler's log-probs where the cache is exact (the last
        # loop's), else the training forward before any update (one forward per batch, or the update's own).
        old = None
        if passes > 1 and (credit or not exact):
            old = [[self._logprobs(self.model, m, credit) for m in micros] for micros in minibatches]
        reference = None
        if self.reference is not None:
            reference = [[self._logprobs(self.reference, m, False) for m in micros] for micros in minibatches]
        ratios = RatioStats(cfg.elr.max_loops, self.device)
        is_weights: dict[tuple[int, int], torch.Tensor | None] = {}

        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # clipped tokens, entropy, KL
        losses, lr, grad_norm = [], 0.0, 0.0
        for _ in range(r.updates_per_batch):
            for b, micros in enumerate(minibatches):
                loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
                scale = self.world_size / denominators[b]  # FSDP averages gradients over the ranks
                for j, m in enumerate(micros):
                    logp, entropy = token_logprobs(
                        self.model,
                        m.tokens,
                        self._loops(m.ks),
                        cfg.training.loss_chunk_tokens,
                        credit,
                        r.temperature,
                        m.kept,
                    )
                    if old is not None:
                        old_m = old[b][j]
                    elif passes > 1:  # exact cache, last-loop credit: the sampler's log-probs are the policy's
                        old_m = m.behaviour
                    else:
                        old_m = logp.detach()
                    if (b, j) not in is_weights:  # the rollout policy against the sampler, once per microbatch
                        last = old_m[-1] if old_m.dim() == 3 else old_m
                        measured = not exact or old_m is not m.behaviour
                        weight, ratio, capped = ratio_and_weights(cfg, m, last, apply=not exact)
                        if measured:
                            ratios.add(m.ks, m.mask, ratio, capped)
                        is_weights[b, j] = weight
                    parts = micro_loss(
                        cfg, m, logp, entropy, old_m, is_weights[b, j], reference[b][j] if reference else None
                    )
                    (parts.loss * scale).backward()
                    loss_sum += parts.loss.detach().double()
                    sums += torch.stack([parts.clipped, parts.entropy, parts.kl]).double()
                reduce_gradients(self.model, self.dims)
                grad_norm = clip_gradients(self.model, cfg.training.max_norm)
                if dist.is_initialized():
                    dist.all_reduce(loss_sum)  # every rank decides on the same loss
                loss = loss_sum.item() / denominators[b]
                losses.append(loss)
                if self.nonfinite.allows_update(step, loss, grad_norm):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                lr = self.lr_scheduler.get_last_lr()[0]
                self.lr_scheduler.step()
        if dist.is_initialized():
            dist.all_reduce(sums)
        train_seconds = time.perf_counter() - start - rollout_seconds
        per_token = max(scored * r.updates_per_batch, 1.0)  # every pass's tokens: the means over the step's updates
        scalars = {
            "loss/train": sum(losses) / len(losses),
            "rl/clip_frac": sums[0].item() / per_token,
            "rl/entropy": sums[1].item() / per_token,
            "grad_norm": grad_norm,
            "lr": lr,
            "rl/rollout_s": rollout_seconds,
            "rl/train_s": train_seconds,
            "rl/rollout_share": rollout_seconds / max(rollout_seconds + train_seconds, 1e-9),
        }
        if reference is not None:
            scalars["rl/kl"] = sums[2].item() / per_token
        scalars.update(ratios.scalars())
        return self._stats(batch, rewards, scalars)

    def _loops(self, ks: list[int]):
        """One int when a microbatch's rows share k (the plain training forward), else per-row budgets
        (every rank runs one forward per microbatch whatever its rows' k, as FSDP needs)."""
        return ks[0] if len(set(ks)) == 1 else torch.tensor(ks, device=self.device)

    @torch.no_grad()
    def _logprobs(self, model, m: Micro, every_loop: bool) -> torch.Tensor:
        """A microbatch's log-probs under `model` before this batch's first update, at the sampling temperature:
        the rollout policy's (the ratio's reference; every loop's with RLTT's credit), or the frozen reference
        model's (the KL's)."""
        r = self.cfg.rl
        loops = self._loops(m.ks)
        return token_logprobs(
            model, m.tokens, loops, self.cfg.training.loss_chunk_tokens, every_loop, r.temperature, m.kept
        )[0]

    def _stats(self, batch: Rollouts, rewards: torch.Tensor, scalars: dict[str, float]) -> StepStats:
        """The step's metrics over every rank: reward and completion length per k, the groups without
        signal (all completions scored alike), generation speed."""
        K, G = self.cfg.elr.max_loops, self.cfg.rl.group_size
        per_k = torch.zeros(3, K, dtype=torch.float64)  # reward sum, completion tokens, completions, per k
        for k, reward, new in zip(batch.loops, batch.rewards, batch.completions):
            per_k[:, k - 1] += torch.tensor([reward, len(new), 1.0], dtype=torch.float64)
        spread = rewards.std(dim=1)
        extra = torch.tensor(
            [
                float((spread == 0).sum()),
                float(spread.sum()),
                float(sum(len(ids) for ids in batch.prompt_ids)),
                float(self.refilled),
            ],
            dtype=torch.float64,
        )
        sums = torch.cat([per_k.flatten(), extra]).to(self.device)
        if dist.is_initialized():
            dist.all_reduce(sums)
        sums = sums.cpu()
        per_k, (no_signal, spread_sum, prompt_tokens, refilled) = sums[: 3 * K].view(3, K), sums[3 * K :].tolist()
        n, generated = per_k[2].sum().item(), per_k[1].sum().item()
        scalars.update(
            {
                "rl/reward": per_k[0].sum().item() / n,
                "rl/reward_std": spread_sum / self.n_groups,
                "rl/zero_std_frac": no_signal / self.n_groups,
                "rl/refilled_frac": refilled / self.n_groups,
                "rl/length": generated / n,
                "rl/gen_tokens_per_s": generated / max(scalars["rl/rollout_s"], 1e-9),
                "rl/tokens": prompt_tokens + generated,
                "loops/mean": (per_k[2] @ torch.arange(1.0, K + 1, dtype=torch.float64)).item() / n,
            }
        )
        for k in range(1, K + 1):
            if per_k[2, k - 1] > 0:
                scalars[f"rl/reward_k{k}"] = (per_k[0, k - 1] / per_k[2, k - 1]).item()
                scalars[f"rl/length_k{k}"] = (per_k[1, k - 1] / per_k[2, k - 1]).item()
        ks = torch.tensor(batch.loops).view(-1, G)[:, 0][None]  # one k per group of this rank
        return StepStats(scalars, ks, torch.zeros(2, K, dtype=torch.float64), {}, False)

    # ---- evaluation and samples ----------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        return self.validator(self.model)

    def write_samples(self, step: int, batch: Rollouts) -> None:
        """A few completions of this step's first group (rank 0), to samples.jsonl beside metrics.jsonl."""
        if self.rank != 0 or self.metrics.failed:
            return
        path = self.dump_folder / "samples.jsonl"
        lines = [
            json.dumps(
                {
                    "step": step,
                    "k": k,
                    "prompt": p.text,
                    "completion": self.tokenizer.decode(c),
                    "answer": p.answer,
                    "reward": rew,
                }
            )
            for p, c, k, rew in list(zip(batch.prompts, batch.completions, batch.loops, batch.rewards))[
                : self.cfg.rl.group_size
            ]
        ]
        try:
            with open(path, "a") as f:
                f.write("\n".join(lines) + "\n")
            self.metrics.log_text(step, "rl/samples", "\n\n".join(lines))
        except OSError as e:
            self.metrics.failed = f"could not write {path} at step {step} ({e.strerror or e})"
