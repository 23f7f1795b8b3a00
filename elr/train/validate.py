"""Validation at every loop count: held-out loss at k = 1..K, and on a task the answer accuracy.

The same held-out batches every time (the first `validation.steps` microbatches of val.bin, or of
the task's validation split), each run at every k, so losses are comparable across steps and k; all
ranks' sums are reduced together. On a task also the accuracy of the answer token at every k, overall
and per difficulty.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from elr.config import JobConfig
from elr.data.loader import val_batches, val_task_batches
from elr.text.tasks import score_answers
from elr.train.loss import IGNORE_INDEX, summed_loss


class Validator:
    def __init__(self, cfg: JobConfig, task, dp_rank: int, dp_world: int, device: torch.device):
        self.cfg, self.task, self.dp_rank, self.dp_world, self.device = cfg, task, dp_rank, dp_world, device
        self.val_path = str(Path(cfg.data.path) / "val.bin")
        if task is None and cfg.validation.freq:  # fail now, not at the first evaluation, if the split is too small
            self._batches()

    def _batches(self):
        t, steps = self.cfg.training, self.cfg.validation.steps
        if self.task is None:
            return (
                (*b, None)
                for b in val_batches(self.val_path, t.seq_len, t.local_batch_size, steps, self.dp_rank, self.dp_world)
            )
        return val_task_batches(self.task, t.seed, t.local_batch_size, steps, self.dp_rank, self.dp_world)

    @torch.no_grad()
    def __call__(self, model, place: Callable, loss: Callable) -> dict[str, float]:
        """place(inputs, labels): this rank's part, on the device; loss(inputs, labels, k): the summed
        cross entropy at k as the trainer's layout computes it (loss_parallel included)."""
        K = self.cfg.elr.max_loops
        model.eval()
        model.record_loop_statistics(False)
        sums = torch.zeros(2, K, dtype=torch.float64, device=self.device)
        if self.task is not None:
            answers = torch.zeros(K, 2, self.task.max_difficulty, dtype=torch.float64, device=self.device)
        for inputs, labels, difficulties in self._batches():
            inputs, labels = place(inputs, labels)
            for k in range(1, K + 1):
                if difficulties is None:
                    sums[0, k - 1] += loss(inputs, labels, k)
                else:  # tasks run without TP / CP: the logits are whole
                    logits = model(inputs, loops=k)
                    sums[0, k - 1] += summed_loss(logits, labels)
                    answers[k - 1] += score_answers(logits, labels, difficulties, self.task.max_difficulty)
                sums[1, k - 1] += (labels != IGNORE_INDEX).sum()
        if dist.is_initialized():
            dist.all_reduce(sums)
        model.train()
        val = {f"val/loss_k{k}": (sums[0, k - 1] / sums[1, k - 1]).item() for k in range(1, K + 1)}
        if self.task is not None:
            if dist.is_initialized():
                dist.all_reduce(answers)
            for k in range(1, K + 1):
                correct, count = answers[k - 1].tolist()
                val[f"val/acc_k{k}"] = sum(correct) / sum(count)
                val.update({f"val/acc_k{k}_d{d}": c / n for d, (c, n) in enumerate(zip(correct, count), 1) if n})
        return val

    def summary(self, step: int, val: dict[str, float]) -> str:
        """The console line of an evaluation."""
        K = self.cfg.elr.max_loops
        line = f"validation at step {step}: " + " | ".join(
            f"k={k} {val[f'val/loss_k{k}']:.4f}" for k in range(1, K + 1)
        )
        if self.task is not None:
            line += " | accuracy " + " ".join(f"k{k} {val[f'val/acc_k{k}']:.3f}" for k in range(1, K + 1))
        return line
