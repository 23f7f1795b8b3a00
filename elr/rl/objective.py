"""The RLVR objective, each formula once: group-relative advantages, the clipped ratio, the KL penalty.

    advantage   A_i = (r_i - mean_g r) / (std_g r + eps)     GRPO (Shao et al. 2024, arXiv 2402.03300)
                A_i =  r_i - mean_g r                        Dr. GRPO (Liu et al. 2025, arXiv 2503.20783)
    ratio       rho_t = exp(log pi(y_t) - log pi_old(y_t))
    surrogate   -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)   PPO's clip (Schulman et al. 2017,
                                                             arXiv 1707.06347) with DAPO's separate upper clip
                                                             (Yu et al. 2025, arXiv 2503.14476)
    kl          exp(q) - q - 1,  q = log pi_ref - log pi      the k3 estimator (Schulman, "Approximating KL
                                                             divergence", 2020): unbiased, never negative

Every token of a completion carries its completion's advantage. The per-token terms are summed; the
caller divides by the batch's completion tokens (GRPO as DAPO normalises it: long completions weigh by
their tokens) or by completions x max_new_tokens (Dr. GRPO: a constant, so no length bias).
"""

from __future__ import annotations

import torch

STD_EPS = 1e-4  # a group whose rewards barely differ gets a large but finite advantage


def group_advantages(rewards: torch.Tensor, scale_by_std: bool) -> torch.Tensor:
    """rewards [groups, G] -> advantages [groups, G]: each reward against its own group's mean (and std).
    A group whose completions all scored alike gets zero advantage: it carries no signal."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + STD_EPS)


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (shapes [N, T], advantages [N] (or [k, N]) broadcast over T): the clipped surrogate loss, and where the
    clip took over (the ratio outside its range on the side that would have grown the objective)."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[..., None]
    unclipped, clipped = ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per token: an estimate of KL(pi || pi_ref) from the sampled token's log-probs under both."""
    q = ref_logp - logp
    return torch.exp(q) - q - 1
