"""Adaptive depth: when a token stops looping (an exit rule), with the loop count k as its cap.

After loop i a token exits, keeping its state s_i, when
    state   ||s_i - s_{i-1}|| / ||s_{i-1}|| < threshold   (its state barely moved)
    kl      KL(p_i || p_{i-1}) < threshold                 (its next-token distribution barely moved:
                                                            the output block and head read s_i after
                                                            every loop, so never before loop 2)
and every token stops at the cap. RecurrentBlock runs the rule (elr/models/recurrence.py); a token
that exited passes the later loops unchanged, as a row past its budget does, and the output block
reads it with the exit FiLM of the loops it ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXIT_RULES = ("state", "kl")


@dataclass(frozen=True)
class ExitRule:
    kind: str  # one of EXIT_RULES
    threshold: float

    def __post_init__(self):
        if self.kind not in EXIT_RULES:
            raise ValueError(f"unknown exit rule {self.kind!r}; use one of {', '.join(EXIT_RULES)}")
        if not self.threshold > 0:
            raise ValueError(f"an exit threshold must be > 0, not {self.threshold}")

    @classmethod
    def parse(cls, text: str) -> ExitRule:
        """'state:0.05' or 'kl:0.01' (the command lines' spelling)."""
        kind, _, threshold = text.partition(":")
        try:
            return cls(kind, float(threshold))
        except ValueError as e:
            raise ValueError(f"exit rule {text!r}: {e}; write RULE:THRESHOLD, e.g. state:0.05 or kl:0.01") from None

    def __str__(self) -> str:
        return f"{self.kind}:{self.threshold:g}"

    @property
    def needs_logits(self) -> bool:
        return self.kind == "kl"

    def exits(
        self, s_prev: torch.Tensor, s: torch.Tensor, logp_prev: torch.Tensor | None, logp: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, T] bool: the tokens the rule lets go after the loop that took s_prev to s (log-probs
        [B, T, vocab] of both states for `kl`; None for the first loop's previous)."""
        if self.kind == "state":
            change = (s - s_prev).float().norm(dim=-1) / s_prev.float().norm(dim=-1).clamp(min=1e-12)
            return change < self.threshold
        if logp_prev is None:
            return torch.zeros(s.shape[:-1], dtype=torch.bool, device=s.device)
        return (logp.exp() * (logp - logp_prev)).sum(-1) < self.threshold
