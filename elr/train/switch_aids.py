"""The late switch's extra objectives: a k = 1 anchor and deeper loops teaching shallower ones.

    k1_anchor         on a microbatch at k = 1 after the switch: + λ(t) Σ_tokens KL(p_teacher ‖ p_model), the
                      teacher a frozen copy of the model as the switch left it (arXiv 2610.12582's switch keeps the
                      one-loop model; this keeps k = 1 near it while the loops grow), λ(t) decaying linearly to 0
    loop_consistency  on a microbatch at k >= 2: + λ Σ_tokens mean_{i<k} KL(sg(p_k) ‖ p_i), p_i the output block's
                      reading of the state after loop i of the same forward (LoopFormer, arXiv 2602.11451)

Both are sums over scored tokens, like the cross entropy they are added to, so the trainer scales them alike.
Neither changes the model: at the switch the anchor's KL and its gradient are exactly zero (the teacher is the
model), and the consistency term is zero wherever the loops compute what k = 1 computes (identity loops).

Under FSDP every rank must call every unit the same number of times: the anchor's teacher is a whole replica on
each rank that never communicates (it runs only where a rank drew k = 1), and the consistency term reads every
exit from the one forward the microbatch runs anyway (elr/models/model.py, `loop_exits`).
"""

from __future__ import annotations

import torch
from torch import nn

from elr.config import JobConfig, switch_step
from elr.models import build_model
from elr.models.args import ModelArgs
from elr.train.loss import IGNORE_INDEX, summed_loss


def summed_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ over scored tokens (labels not IGNORE_INDEX) of KL(softmax(teacher) ‖ softmax(student)), in fp32;
    the teacher's logits carry no gradient."""
    t = teacher_logits.detach().float().log_softmax(-1)
    s = student_logits.float().log_softmax(-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    return (per_token * (labels != IGNORE_INDEX)).sum()


class SwitchObjectives:
    """The anchor and the consistency term of one job (elr.k1_anchor, elr.loop_consistency), and the anchor's
    teacher. `loss` replaces the plain summed cross entropy of a microbatch when `applies`; `report` gives the
    means of the extra terms since the last report, for the metrics."""

    def __init__(self, cfg: JobConfig):
        e = cfg.elr
        self.switch = switch_step(cfg)
        self.anchor, self.consistency = e.k1_anchor, e.loop_consistency
        self.anchor_steps = e.k1_anchor_steps or max(cfg.training.steps - self.switch, 1)
        self.teacher: nn.Module | None = None
        self._sums: dict[str, list[torch.Tensor]] = {}

    @classmethod
    def of(cls, cfg: JobConfig) -> SwitchObjectives | None:
        e = cfg.elr
        return cls(cfg) if e.k1_anchor or e.loop_consistency else None

    def anchor_weight(self, step: int) -> float:
        """λ(t) of update `step`: the full weight at the first mixed-depth update (step switch + 1), falling by
        1 / k1_anchor_steps an update, 0 from then on and before the switch."""
        if not self.anchor or step <= self.switch:
            return 0.0
        return self.anchor * max(0.0, 1 - (step - self.switch - 1) / self.anchor_steps)

    def applies(self, step: int, k: int, mixed_depth: bool) -> bool:
        """Whether update `step`'s microbatch at k gets an extra term."""
        if not mixed_depth:
            return False
        return (k == 1 and self.anchor_weight(step) > 0) or (k >= 2 and self.consistency > 0)

    def build_teacher(self, model_args: ModelArgs, device: torch.device) -> nn.Module:
        """The anchor's teacher, empty: the model's architecture as a plain module (no parallel wrapper),
        frozen, in eval mode; `copy_model` or a checkpoint fills it."""
        with torch.device("meta"):
            teacher = build_model(model_args)
        teacher.to_empty(device=device)
        teacher.init_weights()
        teacher.requires_grad_(False)
        self.teacher = teacher.eval()
        return self.teacher

    @torch.no_grad()
    def copy_model(self, state: dict[str, torch.Tensor]) -> None:
        """The teacher becomes the model whose full (unsharded) state dict this is: the switch point."""
        self.teacher.load_state_dict(state)

    def loss(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        k: int,
        step: int,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross entropy at k, the extra term), both sums over scored tokens, for update `step`;
        document_ids: the packed documents (data.document_masking), kept apart in both forwards."""
        if k == 1:
            logits = model(inputs, loops=1, document_ids=document_ids)
            with torch.no_grad():
                taught = self.teacher(inputs, loops=1, document_ids=document_ids)
            extra = summed_kl(taught, logits, labels)
            self._sums.setdefault("switch/k1_anchor_kl", []).append(extra.detach() / _scored(labels))
            return summed_loss(logits, labels), self.anchor_weight(step) * extra
        exits = model(inputs, loops=k, loop_exits=True, document_ids=document_ids)  # [k, B, T, V]
        last = exits[-1]
        extra = torch.stack([summed_kl(last, exits[i], labels) for i in range(k - 1)]).mean()
        self._sums.setdefault("switch/consistency_kl", []).append(extra.detach() / _scored(labels))
        return summed_loss(last, labels), self.consistency * extra

    def report(self, step: int) -> dict[str, float]:
        """Mean KL per scored token of each term over the microbatches since the last call, and the anchor's
        weight at `step`."""
        scalars = {name: torch.stack(values).mean().item() for name, values in self._sums.items()}
        self._sums = {}
        if self.anchor:
            scalars["switch/k1_anchor_weight"] = self.anchor_weight(step)
        return scalars


def _scored(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum().clamp(min=1)
