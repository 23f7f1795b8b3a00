"""The RLVR objective, each formula once: group-relative advantages, the clipped ratio, the KL penalty, the loss's
normalisation, RLTT's loop weights and DAPO's soft overlong punishment.

    advantage   A_i = (r_i - mean_g r) / (std_g r + eps)     GRPO (Shao et al. 2024, arXiv 2402.03300)
                A_i =  r_i - mean_g r                        Dr. GRPO (Liu et al. 2025, arXiv 2503.20783)
    ratio       rho_t = exp(log pi(y_t) - log pi_old(y_t))
    surrogate   -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)   PPO's clip (Schulman et al. 2017,
                                                             arXiv 1707.06347) with DAPO's separate upper clip
                                                             (Yu et al. 2025, arXiv 2503.14476)
    kl          exp(q) - q - 1,  q = log pi_ref - log pi      the k3 estimator (Schulman, "Approximating KL
                                                             divergence", 2020): unbiased, never negative
    loss        dapo     sum_i sum_t l_it / sum_i |y_i|       (TRL's names for the three normalisations)
                grpo     (1/N) sum_i (1/|y_i|) sum_t l_it
                dr_grpo  sum_i sum_t l_it / (N * max_new_tokens)
    loops       RLTT (arXiv 2602.10520, Eq. 6): sum_t w_t l^(t), l^(t) the loss of the readout after loop t,
                w_t = 1/k (uniform) or t^alpha / sum_s s^alpha (progressive)
    overlong    0 for |y| <= L - B, (L - B - |y|) / B up to -1 at |y| = L     DAPO's soft punishment, L the
                                                             longest completion, B the buffer

Every token of a completion carries its completion's advantage. N and the token counts are an update's
completions on every rank together (the caller counts them).
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


def token_weights(loss_type: str, mask: torch.Tensor) -> torch.Tensor:
    """[N, T]: each scored token's weight in the loss's sum before the update's denominator: 1, or for `grpo`
    1 / its completion's scored tokens (a completion's mean)."""
    mask = mask.float()
    if loss_type == "grpo":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return mask


def loss_denominator(loss_type: str, tokens: float, completions: float, max_new_tokens: int) -> float:
    """What an update's weighted sum is divided by, from its scored tokens and completions over every rank."""
    if loss_type == "dapo":
        return max(tokens, 1.0)
    if loss_type == "grpo":
        return max(completions, 1.0)
    return max(completions * max_new_tokens, 1.0)


def loop_weights(credit: str, loops: int, alpha: float = 1.0) -> torch.Tensor:
    """[loops]: RLTT's weight of the readout after each loop 1..k (`last`: all on loop k)."""
    t = torch.arange(1, loops + 1, dtype=torch.float64)
    if credit == "last":
        return (t == loops).double()
    if credit == "uniform":
        return torch.full((loops,), 1.0 / loops, dtype=torch.float64)
    return t**alpha / (t**alpha).sum()


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a completion of `length` tokens (0 with no buffer)."""
    if buffer == 0 or length <= max_new_tokens - buffer:
        return 0.0
    return max((max_new_tokens - buffer - length) / buffer, -1.0)
