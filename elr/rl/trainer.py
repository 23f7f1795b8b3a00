"""The RLVR stage's trainer: a Trainer whose step is a batch of rollouts and the updates on it.

A step, on every data-parallel rank for its share of the batch:
1. prompts and a loop count per group, drawn from (seed, step) alone (elr/rl/prompts.py, the `[elr]`
   sampler over groups): the same draws on any number of ranks, and after a resume;
2. G completions per prompt sampled at the group's k in one batched decode (mixed budgets in one
   forward, `rl.rollout_kv`'s cache), each row's draws from (seed, step, row, position);
3. rewards, and advantages within each group (elr/rl/objective.py);
4. `rl.updates_per_batch` optimizer updates: per microbatch of completions, the log-probs recomputed by
   the training forward at each row's k, the clipped surrogate (and KL), summed over tokens and divided
   by the batch's denominator (GRPO: its completion tokens; Dr. GRPO: completions x max_new_tokens).
Everything else (checkpoints and exact resume, the console, metrics, signals, the run folder) is the
pretraining Trainer's; this class changes it only through the Trainer's public hooks.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elr.errors import ConfigError
from elr.infer.generate import Sampling, generate
from elr.parallel.gradients import clip_gradients, reduce_gradients
from elr.rl.logprobs import right_padded, scored_positions, token_logprobs
from elr.rl.objective import clipped_surrogate, group_advantages, k3_kl
from elr.rl.prompts import Prompt, drawn, load_prompts, split
from elr.rl.report import RLEvaluator, RLReporter
from elr.rl.rewards import load_reward, score
from elr.text.tokenizer import build_tokenizer
from elr.train.loop_sampler import mix_seed
from elr.train.metrics import log_run_setup
from elr.train.step_report import StepStats
from elr.train.trainer import Trainer

logger = logging.getLogger("elr")


@dataclass
class Rollouts:
    """This rank's completions of one step: one row per completion, `group_size` consecutive rows a group."""

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completions: list[list[int]]  # the new tokens, without the <|endoftext|> that ended a row
    loops: list[int]
    rewards: list[float] = field(default_factory=list)

    def sequences(self, eot_id: int, max_new_tokens: int) -> tuple[list[list[int]], list[int], list[int]]:
        """Prompt + completion token rows (with the <|endoftext|> the policy chose, where it stopped there),
        and each row's scored span [start, end)."""
        rows, starts, ends = [], [], []
        for ids, new in zip(self.prompt_ids, self.completions):
            ended = len(new) < max_new_tokens  # generation stops early only at <|endoftext|>
            row = ids + new + ([eot_id] if ended else [])
            rows.append(row)
            starts.append(len(ids))
            ends.append(len(row))
        return rows, starts, ends


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
        if r.loop_credit == "every_loop" and r.group_size % cfg.training.local_batch_size:
            raise ConfigError(
                f"training.local_batch_size: with rl.loop_credit = every_loop a microbatch must hold "
                f"one group's completions (one k): {cfg.training.local_batch_size} must divide "
                f"rl.group_size = {r.group_size}"
            )
        if r.rollout_compile and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                "rl.rollout_compile: the compiled decode step runs an unsharded model in one process; "
                f"this run has {dist.get_world_size()} ranks (set it false)"
            )
        self.validator = RLEvaluator(self)

    def optimizer_updates(self) -> int:
        """`rl.updates_per_batch` updates per step."""
        return self.cfg.training.steps * self.cfg.rl.updates_per_batch

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
            f"{r.advantage}, clip [{1 - r.clip_low:g}, {1 + r.clip_high:g}], {r.updates_per_batch} update(s) "
            f"per batch, reward {r.reward}"
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

    def uniforms(self, step: int, rows: range):
        """Sampling draws for new token t of this rank's rows: from (seed, step, t) over the whole batch, so
        a completion is the same whichever rank, and however many, sample it."""
        seed = self.cfg.training.seed

        def draw(t: int) -> torch.Tensor:
            gen = torch.Generator().manual_seed(mix_seed(seed + 0x5EED, step * 65_536 + t))
            return torch.rand(self.global_batch, generator=gen, dtype=torch.float64)[rows.start : rows.stop].to(
                self.device
            )

        return draw

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
        r, G = self.cfg.rl, self.cfg.rl.group_size
        groups = self.my_groups()
        ks = self.depths.sampler.sample(step, 1, self.n_groups)[0].tolist()
        chosen = drawn(len(self.prompts), self.cfg.training.seed, step, self.n_groups)
        prompts = [self.prompts[chosen[g]] for g in groups for _ in range(G)]
        prompt_ids = [self.prompt_ids[chosen[g]] for g in groups for _ in range(G)]
        loops = [ks[g] for g in groups for _ in range(G)]
        rows = range(groups.start * G, groups.stop * G)
        self.model.eval()
        self.model.record_loop_statistics(False)
        completions = generate(
            self.model,
            prompt_ids,
            loops,
            r.max_new_tokens,
            self.tokenizer.eot_id,
            kv_mode=r.rollout_kv,
            sampling=Sampling(r.temperature, 0, r.top_p),
            uniforms=self.uniforms(step, rows),
            all_done=self.all_done(),
            compile=r.rollout_compile,
        )
        self.model.train()
        out = Rollouts(prompts, prompt_ids, completions, loops)
        out.rewards = [
            score(self.reward, p.text, self.tokenizer.decode(c), p.answer) for p, c in zip(prompts, completions)
        ]
        return out

    def train_step(self, step: int) -> StepStats:
        cfg, r = self.cfg, self.cfg.rl
        start = time.perf_counter()
        batch = self.rollout(step)
        rollout_seconds = time.perf_counter() - start
        if r.samples_every and step % r.samples_every == 0:
            self.write_samples(step, batch)

        rewards = torch.tensor(batch.rewards, dtype=torch.float64).view(-1, r.group_size)
        advantages = group_advantages(rewards, scale_by_std=r.advantage == "grpo").flatten().float().to(self.device)
        rows, starts, ends = batch.sequences(self.tokenizer.eot_id, r.max_new_tokens)
        scored = torch.tensor(float(sum(e - s for s, e in zip(starts, ends))), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(scored)
        scored = scored.item()  # completion tokens of the whole batch
        denominator = scored if r.advantage == "grpo" else self.global_batch * r.max_new_tokens
        scale = self.world_size / max(denominator, 1.0)  # FSDP averages gradients over the ranks
        every_loop = r.loop_credit == "every_loop"

        # Microbatches of rows in order of k: the deepest row decides a microbatch's cost.
        order = sorted(range(len(rows)), key=lambda i: batch.loops[i])
        size = cfg.training.local_batch_size
        micro = [order[i : i + size] for i in range(0, len(order), size)]
        old = self._logprobs(self.model, rows, batch.loops, micro) if r.updates_per_batch > 1 else None
        reference = self._logprobs(self.reference, rows, batch.loops, micro) if self.reference is not None else None

        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # surrogate, clipped tokens, entropy, KL
        for _ in range(r.updates_per_batch):
            sums.zero_()
            for m, idx in enumerate(micro):
                tokens = right_padded([rows[i] for i in idx], self.tokenizer.eot_id, self.device)
                mask = scored_positions([starts[i] for i in idx], [ends[i] for i in idx], tokens.shape[1], self.device)
                loops = self._loops([batch.loops[i] for i in idx])
                logp, entropy = token_logprobs(self.model, tokens, loops, cfg.training.loss_chunk_tokens, every_loop)
                adv = advantages[idx].expand(loops, -1) if every_loop else advantages[idx]
                per_token, clipped = clipped_surrogate(
                    logp, old[m] if old is not None else logp.detach(), adv, r.clip_low, r.clip_high
                )
                kl = k3_kl(logp, reference[m]) if reference is not None else torch.zeros_like(per_token)
                per_token = per_token + r.kl_coeff * kl
                if every_loop:  # each loop's exit is the policy at that budget: the objective is their mean
                    per_token, clipped, kl, entropy = (
                        per_token.mean(0),
                        clipped.float().mean(0),
                        kl.mean(0),
                        entropy[-1],
                    )
                loss = (per_token * mask).sum()
                (loss * scale).backward()
                sums += torch.stack(
                    [loss.detach(), (clipped * mask).sum(), (entropy * mask).sum(), (kl.detach() * mask).sum()]
                ).double()
            reduce_gradients(self.model, self.dims)
            grad_norm = clip_gradients(self.model, cfg.training.max_norm)
            if self.nonfinite.allows_update(step, sums[0].item() / max(denominator, 1.0), grad_norm):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.lr_scheduler.get_last_lr()[0]
            self.lr_scheduler.step()
        if dist.is_initialized():
            dist.all_reduce(sums)
        train_seconds = time.perf_counter() - start - rollout_seconds
        scalars = {
            "loss/train": sums[0].item() / max(denominator, 1.0),
            "rl/clip_frac": sums[1].item() / max(scored, 1.0),
            "rl/entropy": sums[2].item() / max(scored, 1.0),
            "grad_norm": grad_norm,
            "lr": lr,
            "rl/rollout_s": rollout_seconds,
            "rl/train_s": train_seconds,
            "rl/rollout_share": rollout_seconds / max(rollout_seconds + train_seconds, 1e-9),
        }
        if reference is not None:
            scalars["rl/kl"] = sums[3].item() / max(scored, 1.0)
        return self._stats(batch, rewards, scalars)

    def _loops(self, ks: list[int]):
        """One int when a microbatch's rows share k (the plain training forward), else per-row budgets
        (every rank runs one forward per microbatch whatever its rows' k, as FSDP needs)."""
        return ks[0] if len(set(ks)) == 1 else torch.tensor(ks, device=self.device)

    @torch.no_grad()
    def _logprobs(self, model, rows, loops, micro) -> list[torch.Tensor]:
        """Per microbatch, the log-probs of `model` before this batch's first update: the sampling policy's
        (the ratio's reference), or the frozen reference model's (the KL's)."""
        out = []
        for idx in micro:
            tokens = right_padded([rows[i] for i in idx], self.tokenizer.eot_id, self.device)
            logp, _ = token_logprobs(
                model,
                tokens,
                self._loops([loops[i] for i in idx]),
                self.cfg.training.loss_chunk_tokens,
                self.cfg.rl.loop_credit == "every_loop",
            )
            out.append(logp)
        return out

    def _stats(self, batch: Rollouts, rewards: torch.Tensor, scalars: dict[str, float]) -> StepStats:
        """The step's metrics over every rank: reward and completion length per k, the groups without
        signal (all completions scored alike), generation speed."""
        K, G = self.cfg.elr.max_loops, self.cfg.rl.group_size
        per_k = torch.zeros(3, K, dtype=torch.float64)  # reward sum, completion tokens, completions, per k
        for k, reward, new in zip(batch.loops, batch.rewards, batch.completions):
            per_k[:, k - 1] += torch.tensor([reward, len(new), 1.0], dtype=torch.float64)
        spread = rewards.std(dim=1)
        extra = torch.tensor(
            [float((spread == 0).sum()), float(spread.sum()), float(sum(len(ids) for ids in batch.prompt_ids))],
            dtype=torch.float64,
        )
        sums = torch.cat([per_k.flatten(), extra]).to(self.device)
        if dist.is_initialized():
            dist.all_reduce(sums)
        sums = sums.cpu()
        per_k, (no_signal, spread_sum, prompt_tokens) = sums[: 3 * K].view(3, K), sums[3 * K :].tolist()
        n, generated = per_k[2].sum().item(), per_k[1].sum().item()
        scalars.update(
            {
                "rl/reward": per_k[0].sum().item() / n,
                "rl/reward_std": spread_sum / self.n_groups,
                "rl/zero_std_frac": no_signal / self.n_groups,
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
