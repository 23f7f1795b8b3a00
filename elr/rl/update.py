"""The RLVR update on one batch of rollouts: its minibatches and microbatches, and the loss of a microbatch.

The batch is cut into `rl.minibatches` shares of whole groups (the same on any number of ranks), one optimizer
update each, passed over `rl.updates_per_batch` times (TRL's steps_per_generation and num_iterations). Within a
share the completions go in order of k, `training.local_batch_size` to a forward (the deepest row sets a
microbatch's cost). A microbatch's loss:

    per token   w_IS * surrogate(pi / pi_old, A)  (+ kl_coeff * k3(pi, pi_ref))   summed with the loss type's
                token weights (elr/rl/objective.py), scaled by world / the update's denominator (FSDP averages)

pi and pi_ref are taken at the sampling temperature over the sampler's nucleus (elr/rl/logprobs.py). pi_old, the
ratio's reference, is the rollout policy: with the exact cache (`per_loop`) the sampler's own log-probs (no second
forward); otherwise the training forward with the sampling weights, and w_IS weighs the sampler's samples back to
it (elr/rl/correction.py). With one update per batch pi_old is the forward's own detached log-prob (ratio 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from elr.rl.correction import importance_weights
from elr.rl.logprobs import placed, right_padded, scored_positions
from elr.rl.objective import clipped_surrogate, k3_kl, loop_weights, token_weights
from elr.rl.rollout import Rollouts

EXACT_CACHES = ("per_loop",)  # elr/infer/cache.py: the mode whose decoding is the full-sequence forward's


@dataclass
class Micro:
    """One forward and backward of the update: its completions laid out as the model reads them."""

    rows: list[int]  # indices into the rank's rollouts
    ks: list[int]
    tokens: torch.Tensor  # [b, W] prompt + completion, right-padded
    mask: torch.Tensor  # [b, W - 1] the scored positions (completion tokens, unless filtered)
    weights: torch.Tensor  # [b, W - 1] each scored token's weight in the loss's sum (loss type)
    behaviour: torch.Tensor  # [b, W - 1] the sampler's log-prob of each completion token
    kept: torch.Tensor | None  # [b, W - 1] the sampler's nucleus size (top_p < 1), else None
    advantages: torch.Tensor  # [b]


def minibatch_rows(n_rows: int, group_size: int, minibatches: int) -> list[list[int]]:
    """The rank's rows (in group order) in `minibatches` shares of whole groups, group i in share i mod
    `minibatches`: a rank's first group is a multiple of its group count, itself a multiple of `minibatches`, so a
    share is the same groups of the whole batch on any number of ranks."""
    return [[i for i in range(n_rows) if (i // group_size) % minibatches == m] for m in range(minibatches)]


def plan(
    batch: Rollouts,
    advantages: torch.Tensor,
    cfg,
    eot_id: int,
    vocab: int,
    device,
) -> list[list[Micro]]:
    """Per minibatch, its microbatches: rows in order of k, `training.local_batch_size` at a time."""
    r = cfg.rl
    rows, starts, ends = batch.sequences(eot_id, r.max_new_tokens)
    dropped = batch.truncated(r.max_new_tokens) if r.mask_truncated_completions else [False] * len(rows)
    out = []
    for share in minibatch_rows(len(rows), r.group_size, r.minibatches):
        share = sorted(share, key=lambda i: batch.loops[i])
        micros = []
        for first in range(0, len(share), cfg.training.local_batch_size):
            idx = share[first : first + cfg.training.local_batch_size]
            tokens = right_padded([rows[i] for i in idx], eot_id, device)
            width = tokens.shape[1]
            mask = scored_positions([starts[i] for i in idx], [ends[i] for i in idx], width, device)
            mask &= ~torch.tensor([dropped[i] for i in idx], device=device)[:, None]
            at = [starts[i] for i in idx]
            kept = placed([batch.kept[i] for i in idx], at, width, vocab, device) if r.top_p < 1 else None
            micros.append(
                Micro(
                    idx,
                    [batch.loops[i] for i in idx],
                    tokens,
                    mask,
                    token_weights(r.loss_type, mask),
                    placed([batch.logprobs[i] for i in idx], at, width, 0.0, device),
                    kept,
                    advantages[idx],
                )
            )
        out.append(micros)
    return out


@dataclass
class MicroLoss:
    loss: torch.Tensor  # the weighted sum to backpropagate (before the update's scale)
    clipped: torch.Tensor  # scored tokens the clip took over (loop-weighted)
    entropy: torch.Tensor  # summed over scored tokens (the last loop's)
    kl: torch.Tensor  # k3 summed over scored tokens (0 without a reference)


def micro_loss(
    cfg,
    m: Micro,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old: torch.Tensor,
    is_weight: torch.Tensor | None,
    reference: torch.Tensor | None,
) -> MicroLoss:
    """The loss of one microbatch from its log-probs (`logp` [b, T], or [k, b, T] with RLTT's loop credit), the
    ratio's reference `old` (same shape), the importance weights and the reference model's log-probs ([b, T])."""
    r = cfg.rl
    adv = m.advantages
    if logp.dim() == 3:  # RLTT: each loop's readout its own policy; their losses weighted over the loops
        adv = adv.expand(logp.shape[0], -1)
    per_token, clipped = clipped_surrogate(logp, old, adv, r.clip_low, r.clip_high)
    if logp.dim() == 3:
        w = loop_weights(r.loop_credit, logp.shape[0], r.loop_credit_alpha).to(logp)[:, None, None]
        per_token, clipped, logp = (w * per_token).sum(0), (w * clipped.float()).sum(0), logp[-1]
    if entropy.dim() == 3:
        entropy = entropy[-1]
    if is_weight is not None:
        per_token = per_token * is_weight
    kl = k3_kl(logp, reference) if reference is not None else torch.zeros_like(per_token)
    per_token = per_token + r.kl_coeff * kl  # the KL to the reference is the policy's own: no sample weight
    return MicroLoss(
        (per_token * m.weights).sum(),
        (clipped * m.mask).sum().detach(),
        (entropy * m.mask).sum(),
        (kl.detach() * m.mask).sum(),
    )


class RatioStats:
    """The importance ratio pi_old / mu per k (per completion or per token, as the correction's mode): count, sum,
    min, max and how many the cap changed; reduced over ranks once per step."""

    def __init__(self, K: int, device):
        self.sums = torch.zeros(3, K, dtype=torch.float64, device=device)  # count, sum, capped
        self.low = torch.full((K,), float("inf"), dtype=torch.float64, device=device)
        self.high = torch.full((K,), float("-inf"), dtype=torch.float64, device=device)
        self.measured = False

    def add(self, ks: list[int], mask: torch.Tensor, ratio: torch.Tensor, capped: torch.Tensor) -> None:
        counted = mask.any(-1) if ratio.dim() == 1 else mask  # a completion with scored tokens, or a scored token
        for k in set(ks):
            rows = torch.tensor([x == k for x in ks], device=mask.device)
            sel = counted & (rows if ratio.dim() == 1 else rows[:, None])
            if not sel.any():
                continue
            values = ratio[sel].double()
            self.sums[:, k - 1] += torch.stack([sel.sum().double(), values.sum(), capped[sel].sum().double()])
            self.low[k - 1] = torch.minimum(self.low[k - 1], values.min())
            self.high[k - 1] = torch.maximum(self.high[k - 1], values.max())
        self.measured = True

    def scalars(self) -> dict[str, float]:
        if dist.is_initialized():
            dist.all_reduce(self.sums)
            dist.all_reduce(self.low, op=dist.ReduceOp.MIN)
            dist.all_reduce(self.high, op=dist.ReduceOp.MAX)
        count, total, capped = self.sums.cpu()
        out = {}
        for k in range(1, len(count) + 1):
            if count[k - 1] > 0:
                out[f"rl/is_ratio_mean_k{k}"] = (total[k - 1] / count[k - 1]).item()
                out[f"rl/is_ratio_min_k{k}"] = self.low[k - 1].item()
                out[f"rl/is_ratio_max_k{k}"] = self.high[k - 1].item()
                out[f"rl/is_capped_k{k}"] = (capped[k - 1] / count[k - 1]).item()
        if count.sum() > 0:
            out["rl/is_ratio_mean"] = (total.sum() / count.sum()).item()
            out["rl/is_capped"] = (capped.sum() / count.sum()).item()
        return out


def ratio_and_weights(cfg, m: Micro, old_last: torch.Tensor, apply: bool):
    """The importance ratio of microbatch `m` from the rollout policy's log-probs `old_last` [b, T]: (the weights
    to multiply its loss by, None where the cache is exact and none apply; the ratios; which the cap changed)."""
    r = cfg.rl
    weight, ratio, capped = importance_weights(
        old_last.detach(), m.behaviour, m.mask.float(), r.rollout_correction, r.rollout_correction_cap
    )
    return (weight if apply else None), ratio, capped
