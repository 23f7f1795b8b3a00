"""Cross entropy summed over tokens, from the final hidden states, a chunk of tokens at a time.

The plain loss (`summed_loss`) takes the logits of every token at once: at 32768 tokens per rank and
a 200019-id vocabulary that is a 24.4 GiB fp32 log-softmax kept for backward plus its gradient.
`chunked_cross_entropy` applies the output head to `chunk_tokens` tokens at a time and keeps only
each token's log-sum-exp; backward recomputes each chunk's logits and turns them into that chunk's
gradient, so one chunk's logits (and their gradient) are the only [tokens x vocab] tensors ever alive.
Costs one extra head matmul per chunk (the recompute). Logits are taken in fp32 whatever the
parameter dtype; the head weight's gradient is accumulated over chunks in fp32 (our choice, for a
sum over chunks as exact as the plain path's single matmul) and returned in the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100  # F.cross_entropy's default: such labels add nothing to the loss or gradients


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over tokens, in fp32: updates and evaluations average it over tokens.

    Under tensor parallelism the logits are vocab-sharded and the loss is computed without
    gathering them (loss_parallel); every TP rank gets the whole loss, as a plain tensor.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, weight).float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """hidden [N, D], weight [V, D], labels [N] -> summed cross entropy (fp32 scalar)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(hidden[rows], weight)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            y, kept = labels[rows].clamp(min=0), labels[rows] != IGNORE_INDEX
            total += ((lse[rows] - logits.gather(1, y[:, None]).squeeze(1)) * kept).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h, y, kept = hidden[rows], labels[rows].clamp(min=0), (labels[rows] != IGNORE_INDEX).float()
            # d(lse - logit[y]) / d logits = softmax - one_hot(y), zero on ignored rows; in place.
            grad = _chunk_logits(h, weight).sub_(lse[rows, None]).exp_()
            grad.scatter_add_(1, y[:, None], -torch.ones_like(kept)[:, None])
            grad = grad.mul_((kept * grad_total)[:, None]).to(hidden.dtype)
            if need_hidden:
                torch.mm(grad, weight, out=grad_hidden[rows])
            if need_weight:
                grad_weight += grad.t() @ h  # this chunk's product in the compute dtype, summed in fp32
        return grad_hidden, (grad_weight.to(weight.dtype) if need_weight else None), None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int) -> torch.Tensor:
    """Summed cross entropy of F.linear(hidden, weight) against labels, chunk_tokens tokens at a time.

    hidden: [..., D] (the model's normed final hidden state), weight: [V, D] (the head), labels: [...].
    """
    return ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk_tokens)
