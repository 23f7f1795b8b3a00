"""Cross entropy summed over tokens, from the final hidden states, a chunk of tokens at a time.

The plain loss (`summed_loss`) takes the logits of every token at once: at 32768 tokens per rank and
a 200019-id vocabulary that is a 24.4 GiB fp32 log-softmax kept for backward plus its gradient.
`chunked_cross_entropy` applies the output head to `chunk_tokens` tokens at a time and keeps only
each token's log-sum-exp; backward recomputes each chunk's logits and turns them into that chunk's
gradient, so one chunk's logits (and their gradient) are the only [tokens x vocab] tensors ever alive.
Costs one extra head matmul per chunk (the recompute). Logits are taken in fp32 whatever the
parameter dtype; the head weight's gradient is accumulated over chunks in fp32 (our choice, for a
sum over chunks as exact as the plain path's single matmul) and returned in the weight's dtype.
Under tensor parallelism `vocab_parallel_chunked_cross_entropy` does the same on each rank's vocabulary
rows: a chunk's logits are [chunk_tokens x vocab / tp], and two all-reduces per chunk (the maxima,
then the sums of exponentials with the label's logit) give the whole vocabulary's log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from elr.parallel.tensor_parallel import gather_sequence

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


def _label_columns(labels, vocab_start, n_ids):
    """Each label's column among this rank's ids vocab_start..vocab_start + n_ids (clamped into range),
    and whether this rank owns it (ignored labels, -100, are owned by no rank)."""
    local = labels - vocab_start
    return local.clamp(0, n_ids - 1), (local >= 0) & (local < n_ids)


def _lse_and_label_logit(logits, labels, vocab_start, group):
    """Per token: log-sum-exp over the whole vocabulary and the label's logit (0 where ignored).

    logits [n, V_local] hold ids vocab_start..vocab_start + V_local; with a TP group the other ranks
    hold the rest: their maxima, sums of exponentials and the owner's label logit are all-reduced.
    """
    column, owned = _label_columns(labels, vocab_start, logits.shape[1])
    label_logit = logits.gather(1, column[:, None]).squeeze(1) * owned
    if group is None:
        return torch.logsumexp(logits, dim=-1), label_logit
    peak = logits.amax(dim=-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([(logits - peak[:, None]).exp().sum(-1), label_logit])
    dist.all_reduce(sums, group=group)
    return peak + sums[0].log(), sums[1]


class ChunkedCrossEntropy(torch.autograd.Function):
    """hidden [N, D], weight [V, D], labels [N] -> summed cross entropy (fp32 scalar).

    Vocab-parallel with a TP group: weight holds ids vocab_start.. of the vocabulary, every rank
    returns the whole loss, and the gradients are this rank's: its weight rows' (complete) and its
    vocabulary's share of the hidden states' (the caller sums those over the group).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, vocab_start=0, group=None):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            lse[rows], label_logit = _lse_and_label_logit(
                _chunk_logits(hidden[rows], weight), labels[rows], vocab_start, group
            )
            total += ((lse[rows] - label_logit) * (labels[rows] != IGNORE_INDEX)).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens, ctx.vocab_start = chunk_tokens, vocab_start
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h, kept = hidden[rows], (labels[rows] != IGNORE_INDEX).float()
            column, owned = _label_columns(labels[rows], ctx.vocab_start, weight.shape[0])
            # d(lse - logit[y]) / d logits = softmax - one_hot(y), zero on ignored rows; in place.
            grad = _chunk_logits(h, weight).sub_(lse[rows, None]).exp_()
            grad.scatter_add_(1, column[:, None], -owned.float()[:, None])
            grad = grad.mul_((kept * grad_total)[:, None]).to(hidden.dtype)
            if need_hidden:
                torch.mm(grad, weight, out=grad_hidden[rows])
            if need_weight:
                grad_weight += grad.t() @ h  # this chunk's product in the compute dtype, summed in fp32
        return grad_hidden, (grad_weight.to(weight.dtype) if need_weight else None), None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Summed cross entropy of F.linear(hidden, weight) against labels, chunk_tokens tokens at a time.

    hidden: [..., D] (the model's normed final hidden state), weight: [V, D] (the head), labels: [...].
    """
    return ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk_tokens)


def model_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    loops: int,
    chunk_tokens: int,
    tensor_parallel: bool,
    every_loop: bool = False,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed cross entropy of the model at `loops`; chunked (chunk_tokens > 0) or whole. every_loop:
    each token's loss is the mean over the exits after loops 1..k (ELRModel.forward's every_loop).
    document_ids [B, T] (aligned with inputs; None: no masking): the documents packed into each row
    never see each other (ELRModel.forward's document_ids).

    The chunked loss applies the head outside the model's forward: under FSDP the root unit keeps
    its weights (the head's among them) gathered from forward until its backward. Under TP the head
    is vocab-sharded (a DTensor) and the model returns this rank's sequence slice: the vocab-parallel
    variant takes both as they are. (Under TP the caller runs forward and backward in loss_parallel.)
    """
    out = model(inputs, loops=loops, head=chunk_tokens == 0, every_loop=every_loop, document_ids=document_ids)
    if every_loop:
        out, labels = out.flatten(0, 1), labels.repeat(loops, 1)
    if chunk_tokens == 0:
        loss = summed_loss(out, labels)
    else:
        chunked = vocab_parallel_chunked_cross_entropy if tensor_parallel else chunked_cross_entropy
        loss = chunked(out, model.output.weight, labels, chunk_tokens)
    return loss / loops if every_loop else loss


def vocab_parallel_chunked_cross_entropy(
    hidden: torch.Tensor, weight: DTensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """chunked_cross_entropy under tensor parallelism, without gathering the head or the logits.

    hidden: this rank's sequence slice [B, T / tp, D] (sequence parallel); weight: the head as a
    DTensor, vocab rows split over the TP mesh (Shard(0); DTensor splits like torch.chunk, the last
    shard shorter when tp does not divide V); labels: the whole [B, T]. The slices are all-gathered
    (backward: reduce-scatter, which sums the ranks' vocabulary shares of the hidden gradient); each
    chunk's logits are [n, V / tp]. Every TP rank returns the whole summed loss, as loss_parallel does.
    """
    mesh = weight.device_mesh
    assert mesh.ndim == 1 and weight.placements == (Shard(0),), weight.placements
    local = weight.to_local()
    rows_per_rank = -(-weight.shape[0] // mesh.size())
    vocab_start = min(mesh.get_local_rank() * rows_per_rank, weight.shape[0])
    assert local.shape[0] == min(weight.shape[0] - vocab_start, rows_per_rank), (local.shape, vocab_start)
    hidden = gather_sequence(hidden, mesh)
    return ChunkedCrossEntropy.apply(
        hidden.flatten(0, -2), local, labels.flatten(), chunk_tokens, vocab_start, mesh.get_group()
    )
