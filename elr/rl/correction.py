"""Truncated importance sampling from the rollouts' sampler to the training policy, for a rollout cache that is not
exact (`rl.rollout_kv` other than `per_loop`: at k >= 2 later tokens read earlier tokens' last-loop keys and
values, so the sampler mu is not the training forward's pi).

    token      w_t = pi_old(y_t) / mu(y_t)                  one ratio per completion token
    sequence   w   = prod_t pi_old(y_t) / mu(y_t)           one ratio per completion, on every token
    truncate   w <- min(w, cap)                            mask   w <- 0 where w > cap

pi_old is the training forward with the weights that sampled, mu the sampler's own log-prob of each chosen
token (elr/infer/generate.py). Every token's loss is multiplied by its w: the update then estimates the
policy gradient of pi from samples of mu, biased only where the cap binds (Ionides 2008's truncation; the modes,
names and default cap are TRL's for vLLM rollouts, `vllm_importance_sampling_*`).
"""

from __future__ import annotations

import torch


def importance_weights(
    old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """old, behaviour, mask [N, T] (log-probs of the chosen tokens; the completion tokens) -> (the weight of every
    token [N, T], the ratios before the cap, and which of them the cap changed): per token [N, T] for `token_*`
    modes (only masked positions meaningful), per completion [N] for `sequence_*`."""
    diff = (old - behaviour) * mask
    ratio = torch.exp(diff.sum(-1) if mode.startswith("sequence") else diff)
    capped = ratio > cap
    weight = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(capped, 0.0)
    if mode.startswith("sequence"):
        weight = weight[:, None].expand_as(mask)
    return weight * mask, ratio, capped
