"""What the RLVR stage reports: its console line and metrics (RLReporter), and its evaluation (RLEvaluator):
the held-out prompts answered greedily at every k, with the reward (accuracy, for `exact`) and the
completion length per k, the two numbers the paper's claim is about (more loops, fewer tokens).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from elr.config import JobConfig
from elr.console.progress import duration
from elr.infer.generate import Sampling, generate
from elr.rl.rewards import score
from elr.train.metrics import MetricsLogger
from elr.train.step_report import StepStats, memory_gib

logger = logging.getLogger("elr")

# The scalars whose means over the logging window make the console line.
WINDOW = (
    "rl/reward",
    "rl/length",
    "rl/clip_frac",
    "rl/entropy",
    "grad_norm",
    "rl/rollout_share",
    "rl/gen_tokens_per_s",
    "rl/zero_std_frac",
    "rl/is_capped",
)


class RLReporter:
    """Every step's scalars into metrics.jsonl (and TensorBoard, W&B); every `metrics.log_freq` steps (and
    the first and last) one console line of the window's means, reward per k among them."""

    def __init__(self, cfg: JobConfig, metrics: MetricsLogger, world_size: int, device: torch.device):
        self.cfg, self.metrics, self.device = cfg, metrics, device
        self.session_start = time.perf_counter()
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.per_k: dict[int, list[float]] = {}  # k -> [summed step means, steps that drew k]
        self.steps, self.seconds = 0, 0.0

    def report(self, step: int, stats: StepStats, seconds: float, model, tokens_seen: int) -> None:
        s, K = stats.scalars, self.cfg.elr.max_loops
        s["memory/max_gib"] = memory_gib(self.device)
        self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        for name in WINDOW:
            self.sums[name] = self.sums.get(name, 0.0) + s.get(name, 0.0)
        for k in range(1, K + 1):
            if f"rl/reward_k{k}" in s:
                total = self.per_k.setdefault(k, [0.0, 0.0])
                total[0] += s[f"rl/reward_k{k}"]
                total[1] += 1
        self.metrics.log(step, s, {"loops": stats.ks.tolist(), "tokens": tokens_seen})
        total_steps = self.cfg.training.steps
        if step % self.cfg.metrics.log_freq and step != 1 and step != total_steps:
            return
        mean = {name: value / self.steps for name, value in self.sums.items()}
        per_k = " ".join(f"k{k} {r / n:.3f}" for k, (r, n) in sorted(self.per_k.items()) if n)
        eta = self.seconds / self.steps * (total_steps - step)
        logger.info(
            f"step {step:>{len(str(total_steps))}}/{total_steps} | reward {mean['rl/reward']:.3f} ({per_k}) | "
            f"len {mean['rl/length']:.1f} | no signal {mean['rl/zero_std_frac']:.0%} | "
            f"clip {mean['rl/clip_frac']:.3f} | "
            + (
                f"IS mean {s['rl/is_ratio_mean']:.3f} capped {mean['rl/is_capped']:.1%} | "
                if "rl/is_capped" in s
                else ""
            )
            + f"entropy {mean['rl/entropy']:.3f} | lr {s['lr']:.2e} | gnorm {mean['grad_norm']:.3f} | "
            f"rollout {mean['rl/rollout_share']:.0%} of the step, {mean['rl/gen_tokens_per_s']:,.0f} tok/s | "
            f"mem {s['memory/max_gib']:.2f} GiB | elapsed {duration(time.perf_counter() - self.session_start)} | "
            f"eta {duration(eta)}"
        )
        self.reset()


class RLEvaluator:
    """The held-out prompts answered greedily at k = 1..K: mean reward and completion length per k. Each rank
    answers its share (the same count on every rank, the last padded with repeats that are not counted, so
    every rank runs the same forwards)."""

    def __init__(self, trainer):
        self.trainer = trainer

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        t = self.trainer
        r, K = t.cfg.rl, t.cfg.elr.max_loops
        prompts = t.eval_prompts
        share = math.ceil(len(prompts) / t.dp_world)
        mine = [t.dp_rank * share + i for i in range(share)]
        counted = torch.tensor([float(i < len(prompts)) for i in mine])
        mine = [prompts[i % len(prompts)] for i in mine]
        ids = [p.encode(t.tokenizer) for p in mine]
        model.eval()
        model.record_loop_statistics(False)
        sums = torch.zeros(3, K, dtype=torch.float64)  # reward, completion tokens, prompts
        for k in range(1, K + 1):
            completions = generate(
                model,
                ids,
                k,
                r.max_new_tokens,
                t.tokenizer.eot_id,
                kv_mode=r.rollout_kv,
                sampling=Sampling(),
                all_done=t.all_done(),
                compile=r.rollout_compile,
            )
            for p, c, w in zip(mine, completions, counted.tolist()):
                sums[:, k - 1] += w * torch.tensor(
                    [score(t.reward, p.text, t.tokenizer.decode(c), p.answer), len(c), 1.0], dtype=torch.float64
                )
        model.train()
        sums = sums.to(t.device)
        if dist.is_initialized():
            dist.all_reduce(sums)
        sums = sums.cpu()
        val = {}
        for k in range(1, K + 1):
            val[f"val/reward_k{k}"] = (sums[0, k - 1] / sums[2, k - 1]).item()
            val[f"val/length_k{k}"] = (sums[1, k - 1] / sums[2, k - 1]).item()
        return val

    def summary(self, step: int, val: dict[str, float]) -> str:
        K = self.trainer.cfg.elr.max_loops
        n = len(self.trainer.eval_prompts)
        return (
            f"evaluation at step {step} ({n} held-out prompts, greedy): reward "
            + " ".join(f"k{k} {val[f'val/reward_k{k}']:.3f}" for k in range(1, K + 1))
            + " | completion tokens "
            + " ".join(f"k{k} {val[f'val/length_k{k}']:.1f}" for k in range(1, K + 1))
        )
