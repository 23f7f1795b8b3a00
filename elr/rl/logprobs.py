"""Per-token log-probabilities of completions under the model at a loop count, as the update needs them: of the
distribution the rollouts sampled from (the logits over `rl.temperature`, cut to the sampler's own nucleus size
where `rl.top_p` < 1), so the update scores exactly what the sampler drew.

Sequences are prompt + completion, right-padded: causal layers never read a later position, so padding
after a row's end changes none of its log-probs, and every row starts at position 0 as it did when it
was sampled. The head runs a chunk of tokens at a time under activation checkpointing when
`training.loss_chunk_tokens` asks (one chunk's [tokens x vocab] logits alive at once, recomputed in
backward), else on the whole microbatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from elr.models.budget import LoopBudget


def right_padded(rows: list[list[int]], pad_id: int, device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def scored_positions(starts: list[int], ends: list[int], width: int, device) -> torch.Tensor:
    """[B, width - 1]: position t predicts token t + 1; it counts when that token is a completion token
    (index in [start, end) of its row)."""
    t = torch.arange(1, width, device=device)[None]
    return (t >= torch.tensor(starts, device=device)[:, None]) & (t < torch.tensor(ends, device=device)[:, None])


def placed(values: list[torch.Tensor], starts: list[int], width: int, fill, device) -> torch.Tensor:
    """[B, width - 1]: each row's per-completion-token values (token j of the completion at its position
    start + j - 1, the position that predicts it), `fill` elsewhere."""
    dtype = values[0].dtype if values else torch.float32
    out = torch.full((len(values), width - 1), fill, dtype=dtype)
    for i, (v, start) in enumerate(zip(values, starts)):
        out[i, start - 1 : start - 1 + len(v)] = v.cpu()
    return out.to(device)


def nucleus(logits: torch.Tensor, targets: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Each position's logits cut to its `kept` most likely tokens (the sampler's count: the same nucleus where
    the sampler's logits are the update's), the sampled token always among them; the rest at -inf."""
    with torch.no_grad():
        ordered = logits.sort(-1, descending=True).values
        threshold = ordered.gather(-1, (kept.clamp(1, logits.shape[-1]) - 1)[..., None])
        keep = logits >= threshold
        keep.scatter_(-1, targets[..., None], True)
    return logits.masked_fill(~keep, float("-inf"))


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, kept: torch.Tensor | None):
    logits = logits.float() / temperature
    if kept is not None:
        logits = nucleus(logits, targets, kept)
    logp = logits.log_softmax(-1)
    with torch.no_grad():  # a metric: no graph over another [tokens x vocab] tensor
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), entropy


def _head_logprobs(hidden, weight, targets, temperature, kept):
    return _logprobs(F.linear(hidden, weight), targets, temperature, kept)


def token_logprobs(
    model,
    tokens: torch.Tensor,
    loops: LoopBudget,
    chunk_tokens: int = 0,
    every_loop: bool = False,
    temperature: float = 1.0,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of tokens[:, 1:] given what precedes each, the distribution's entropy there), both [B, T - 1], p the
    model's distribution at `temperature` (cut to `kept` [B, T - 1] tokens where given); with every_loop
    [k, B, T - 1]: at the exit of each loop 1..k (the model at each budget up to k)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if every_loop:
        targets = targets.expand(loops, *targets.shape)
        kept = kept.expand(loops, *kept.shape) if kept is not None else None
    if chunk_tokens == 0:
        return _logprobs(model(inputs, loops=loops, every_loop=every_loop), targets, temperature, kept)
    hidden = model(inputs, loops=loops, head=False, every_loop=every_loop)
    shape = targets.shape
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    kept = kept.flatten() if kept is not None else None
    logp, entropy = [], []
    # Under FSDP the root unit keeps the head gathered from forward until its backward (elr/train/loss.py).
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        lp, ent = checkpoint(
            _head_logprobs,
            hidden[rows],
            model.output.weight,
            targets[rows],
            temperature,
            kept[rows] if kept is not None else None,
            use_reentrant=False,
        )
        logp.append(lp)
        entropy.append(ent)
    return torch.cat(logp).view(shape), torch.cat(entropy).view(shape)
