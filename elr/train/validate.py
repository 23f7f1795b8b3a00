"""Validation at every loop count: held-out loss at k = 1..K, per source of a mixture, and on a task the
answer accuracy.

The same held-out batches every time (the first `validation.steps` microbatches of the validation split,
elr/data/validation.py, or of the task's validation split), each run at every k, so losses are comparable
across steps and k; all ranks' sums are reduced together. A mixture (`data.sources`) validates each source
that has validation data on its own `validation.steps` batches: `val/loss_k{k}/{source}` is that source's
loss, and `val/loss_k{k}` the mixture's, the sources' losses weighted as the mixture weighs them in training.
On a task also the accuracy of the answer token at every k, overall and per difficulty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from elr.config import JobConfig
from elr.data.loader import Batch
from elr.data.stores import is_foreign, store_and_split
from elr.data.validation import val_batches, val_store, val_task_batches, window_batches
from elr.errors import ConfigError
from elr.text.tasks import score_answers
from elr.train.loss import IGNORE_INDEX, summed_loss


class Validator:
    def __init__(
        self, cfg: JobConfig, task, dp_rank: int, dp_world: int, device: torch.device, vocab_size: int | None = None
    ):
        self.cfg, self.task, self.dp_rank, self.dp_world, self.device = cfg, task, dp_rank, dp_world, device
        self.vocab_size = vocab_size
        self.by_source = bool(cfg.data.sources) and task is None  # metrics per source beside the mixture's
        # (name, weight, this rank's batches): one set per validated source; fail now, not at the first
        # evaluation, if a split is missing or too small
        self.sets: list[tuple[str, float, Callable[[], Iterator[Batch]]]] = []
        if task is None and cfg.validation.freq:
            self.sets = self._sets()
            for _, _, batches in self.sets:
                batches()

    def _sets(self) -> list[tuple[str, float, Callable[[], Iterator[Batch]]]]:
        d, t, steps = self.cfg.data, self.cfg.training, self.cfg.validation.steps
        shape = (t.seq_len, t.local_batch_size, steps, self.dp_rank, self.dp_world)
        if not d.sources:
            if is_foreign(store_and_split(d.path)[0]):
                raise ConfigError(
                    f"validation.freq: data.path {d.path} holds one stream (Megatron or datatrove), no validation "
                    "split; set validation.freq = 0, or name it in [[data.sources]] with a val_path"
                )
            return [(d.path, 1.0, lambda: val_batches(d.path, *shape, d.document_masking))]
        sets = []
        for spec in d.sources:
            store = val_store(spec)
            if store is not None:
                sets.append(
                    (
                        spec.name,
                        spec.weight,
                        lambda s=store: window_batches(s, *shape, d.document_masking, self.vocab_size),
                    )
                )
        if not sets:
            raise ConfigError(
                "validation.freq: no source of data.sources has validation data (a prepared folder's val split, or "
                "a val_path); set validation.freq = 0 or give a source a val_path"
            )
        return sets

    @torch.no_grad()
    def __call__(self, model, place: Callable, loss: Callable) -> dict[str, float]:
        """place(batch): this rank's part, on the device; loss(inputs, labels, k, document_ids): the summed
        cross entropy at k as the trainer's layout computes it (loss_parallel included)."""
        if self.task is not None:
            return self._task(model, place)
        K = self.cfg.elr.max_loops
        model.eval()
        model.record_loop_statistics(False)
        sums = torch.zeros(len(self.sets), 2, K, dtype=torch.float64, device=self.device)
        for i, (_, _, batches) in enumerate(self.sets):
            for batch in batches():
                inputs, labels, document_ids = place(batch)
                for k in range(1, K + 1):
                    sums[i, 0, k - 1] += loss(inputs, labels, k, document_ids)
                    sums[i, 1, k - 1] += (labels != IGNORE_INDEX).sum()
        if dist.is_initialized():
            dist.all_reduce(sums)
        model.train()
        per_source = (sums[:, 0] / sums[:, 1]).tolist()  # [sets][K]
        weights = [w for _, w, _ in self.sets]
        val = {
            f"val/loss_k{k}": sum(w * losses[k - 1] for w, losses in zip(weights, per_source)) / sum(weights)
            for k in range(1, K + 1)
        }
        if self.by_source:
            for (name, _, _), losses in zip(self.sets, per_source):
                val.update({f"val/loss_k{k}/{name}": losses[k - 1] for k in range(1, K + 1)})
        return val

    def _task(self, model, place: Callable) -> dict[str, float]:
        """A task's validation: the answer's loss and accuracy at every k, overall and per difficulty (the task
        runs without TP or CP, so the logits are whole)."""
        K, t = self.cfg.elr.max_loops, self.cfg.training
        model.eval()
        model.record_loop_statistics(False)
        sums = torch.zeros(2, K, dtype=torch.float64, device=self.device)
        answers = torch.zeros(K, 2, self.task.max_difficulty, dtype=torch.float64, device=self.device)
        steps = self.cfg.validation.steps
        for inputs, labels, difficulties in val_task_batches(
            self.task, t.seed, t.local_batch_size, steps, self.dp_rank, self.dp_world
        ):
            inputs, labels, _ = place(Batch(inputs, labels))
            for k in range(1, K + 1):
                logits = model(inputs, loops=k)
                sums[0, k - 1] += summed_loss(logits, labels)
                answers[k - 1] += score_answers(logits, labels, difficulties, self.task.max_difficulty)
                sums[1, k - 1] += (labels != IGNORE_INDEX).sum()
        if dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(answers)
        model.train()
        val = {f"val/loss_k{k}": (sums[0, k - 1] / sums[1, k - 1]).item() for k in range(1, K + 1)}
        for k in range(1, K + 1):
            correct, count = answers[k - 1].tolist()
            val[f"val/acc_k{k}"] = sum(correct) / sum(count)
            val.update({f"val/acc_k{k}_d{d}": c / n for d, (c, n) in enumerate(zip(correct, count), 1) if n})
        return val

    def summary(self, step: int, val: dict[str, float]) -> str:
        """The console line of an evaluation: the loss at every k; each source's at the deepest k; on a task the
        accuracy at every k."""
        K = self.cfg.elr.max_loops
        line = f"validation at step {step}: " + " | ".join(
            f"k={k} {val[f'val/loss_k{k}']:.4f}" for k in range(1, K + 1)
        )
        if self.by_source:
            line += f" | by source at k={K}: " + " ".join(
                f"{name} {val[f'val/loss_k{K}/{name}']:.4f}" for name, _, _ in self.sets
            )
        if self.task is not None:
            line += " | accuracy " + " ".join(f"k{k} {val[f'val/acc_k{k}']:.3f}" for k in range(1, K + 1))
        return line
