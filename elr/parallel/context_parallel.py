"""Context parallelism of our own: each rank of a CP group holds one contiguous slice of every sequence.

torch's `context_parallel` has no CPU path, so this is built from plain torch.distributed
collectives (gloo and NCCL alike) with autograd; torch derives every backward.

    attention  all-gathers K and V over the group (backward: reduce-scatter of dK, dV) and masks
               causally from the shard's start: the query at global position p sees keys <= p.
    documents  (document masking, elr/models/documents.py) the document ids of every shard are
               all-gathered, so each rank knows where its documents started: RoPE positions, the
               block-causal mask over the gathered keys and the GDP resets are those of the whole
               sequence. A reset zeroes the GDP state, so a shard with one has transition P = 0
               from that token on: the chain below needs no other change.
    GDP        the recurrence is affine in its state, S_end = P S_start + Q, so each rank runs its
               shard once from the state [I | 0] with values [0 | v]: that one call gives its
               transition P, its zero-start summary Q and, per token, what o owes the unknown
               start state. The (P, Q) of every rank are all-gathered and chained in rank order,
               S_start(r) = P_{r-1} S_start(r-1) + Q_{r-1}, and each rank corrects its output with
               its true start state (the idea of flash-linear-attention's CP for gated delta rules;
               the single-call form is our choice). The chain is plain autograd ops, so its backward
               is torch's.
    short conv each rank takes the last conv_size - 1 projected inputs of the previous rank as its
               convolution state (rank 0: zeros).

The model code never touches torch.distributed: `enable_context_parallel` installs one
`ContextParallel` hook on the model (RoPE positions) and on its attention and GDP sublayers, which
call its methods where a whole sequence would otherwise be at hand, as `MoE.expert_parallel` is
installed by elr/parallel/expert_parallel.py.

Collectives in backward must run on every rank: each rank's result depends on the whole gathered
tensor (never only on its own piece), so autograd reaches every gather's backward on every rank.
Shards are contiguous (not head-tail balanced: the GDP chain needs rank order = sequence order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from elr.models.layers import LAYER_KINDS
from elr.models.model import ELRModel
from elr_kernels.gated_delta_product import gated_delta_product


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_degree: int) -> torch.Tensor:
    """This rank's contiguous slice of the sequence dim (dim 1) of tokens or labels [B, T, ...]."""
    T = x.shape[1]
    if T % cp_degree:
        raise ValueError(f"sequence length {T} is not divisible by the context-parallel degree {cp_degree}")
    shard = T // cp_degree
    return x[:, cp_rank * shard : (cp_rank + 1) * shard]


class ContextParallel:
    """The hook the model and its sequence mixers call under context parallelism (`context_parallel`
    on ELRModel, Attention and GatedDeltaProduct): this rank's place in the sequence and the
    collectives that stand in for the rest of it."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def positions(self, shard_len: int) -> tuple[int, int]:
        """(global position of this shard's first token, the whole sequence's length)."""
        return shard_start(self.group, shard_len), dist.get_world_size(self.group) * shard_len

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor):
        """Attention: this shard's and every earlier shard's keys and values, and their mask (`gather_kv`)."""
        return gather_kv(k, v, self.group)

    def conv_states(self, inputs: list[torch.Tensor], width: int) -> list[torch.Tensor]:
        """GDP: the short convolutions' state at this shard's start (`conv_halos`)."""
        return conv_halos(inputs, width, self.group)

    def gather_document_ids(self, document_ids: torch.Tensor) -> torch.Tensor:
        """Documents: the ids [B, T * cp] of the whole sequence from every shard's [B, T]."""
        return all_gather(document_ids, self.group, dim=1)

    def gated_delta_product(
        self, q, k, v, g, beta, *, num_householder: int, impl: str, resets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """GDP: this shard's output of the recurrence over the whole sequence
        (`context_parallel_gated_delta_product`)."""
        return context_parallel_gated_delta_product(
            q, k, v, g, beta, num_householder=num_householder, group=self.group, impl=impl, resets=resets
        )


def enable_context_parallel(model: ELRModel, cp_mesh: DeviceMesh) -> None:
    """Install the CP hook on the model (RoPE positions) and on the sublayers of every kind that mixes
    tokens (`LayerKind.mixes_tokens`: attention, GDP).

    Inputs must then be `shard_sequence` slices, the same length on every rank of the group.
    """
    hook = ContextParallel(cp_mesh.get_group())
    model.context_parallel = hook
    for layer in model.layers():
        if LAYER_KINDS[layer.kind].mixes_tokens:
            layer.sublayer.context_parallel = hook


def shard_start(group: dist.ProcessGroup, shard_len: int) -> int:
    """Global position of this rank's first token."""
    return dist.get_rank(group) * shard_len


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order, differentiably (backward: a
    reduce-scatter, summing the gradients and keeping this rank's piece)."""
    gathered = funcol.all_gather_single_autograd(x.movedim(dim, 0).contiguous(), gather_dim=0, group=group)
    return gathered.movedim(0, dim)


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup):
    """Keys and values [B, H_kv, T, D] of this shard and every earlier one, with the mask that lets
    the query at global position p see keys <= p.

    Later shards' keys would be masked out entirely, so they are dropped: the T queries then face
    start + T keys, and "key <= query" is the causal mask aligned to the bottom-right corner.
    `lower_right_causal` says so without a [T, start + T] tensor (at 256K context with CP 8 a boolean
    mask would take 8 GiB per call); SDPA runs it with the flash kernel on GPU and materialises it
    only on the math path (CPU).
    """
    T = k.shape[2]
    start = shard_start(group, T)
    kv = all_gather(torch.stack([k, v]), group, dim=3)[..., : start + T, :]
    with _disable_current_modes():  # selective AC's dispatch mode cannot create a tensor subclass
        mask = lower_right_causal(T, start + T)
    return kv[0], kv[1], mask


def lower_right_causal(q_len: int, kv_len: int) -> CausalBias:
    """`causal_lower_right(q_len, kv_len)` without its dense allocation: in our torch, CausalBias hands
    its arguments to the legacy Tensor constructor, which allocates an uninitialised [2, q_len, kv_len]
    fp32 tensor that nothing reads (64 GiB of host memory per call at 256K over CP 8; measured). Built
    at 1 x 1, then given its real lengths, which are all SDPA and the mask's materialisation read."""
    bias = causal_lower_right(1, 1)
    bias.seq_len_q, bias.seq_len_kv = q_len, kv_len
    return bias


def conv_halos(inputs: list[torch.Tensor], width: int, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The previous rank's last `width` positions of each input [B, T, C_i] (zeros on rank 0):
    the short convolutions' state at this shard's start. One gather for all inputs."""
    T = inputs[0].shape[1]
    if T < width:
        raise ValueError(f"context parallel needs at least conv_size - 1 = {width} tokens per shard, got {T}")
    tails = torch.cat([x[:, T - width :] for x in inputs], dim=-1)
    gathered = all_gather(tails[None], group, dim=0)  # [cp, B, width, sum C_i]
    previous = torch.cat([torch.zeros_like(gathered[:1]), gathered[:-1]])[dist.get_rank(group)]
    return list(previous.split([x.shape[-1] for x in inputs], dim=-1))


def context_parallel_gated_delta_product(
    q,
    k,
    v,
    g,
    beta,
    *,
    num_householder: int,
    group: dist.ProcessGroup,
    initial_state: torch.Tensor | None = None,
    impl: str = "auto",
    resets: torch.Tensor | None = None,
):
    """`gated_delta_product` over a sequence split across `group`; this rank passes its shard.

    Shapes as in `gated_delta_product`; `initial_state` [B, H, K, V] (the same on every rank) is
    the state before the first shard; `resets` [B, T] this shard's (a reset on its first token drops
    everything before it). Returns this shard's o [B, T, H, V] (no final state: CP is for training).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    # State [I | 0] with values [0 | v]: columns :K of the state track P (the shard's transition
    # from its start state), columns K: track the state from a zero start; the output splits alike.
    identity = torch.eye(K, dtype=torch.float32, device=q.device).expand(B, H, K, K)
    start = torch.cat([identity, identity.new_zeros(B, H, K, V)], dim=-1)
    values = torch.cat([v.new_zeros(*v.shape[:-1], K), v], dim=-1)
    o, summary = gated_delta_product(
        q,
        k,
        values,
        g,
        beta,
        num_householder=num_householder,
        impl=impl,
        initial_state=start,
        output_final_state=True,
        resets=resets,
    )
    o_start, o_zero = o.float().split([K, V], dim=-1)  # o_start[t] = scale P_t^T q_t

    # Chain every rank's (P, Q) in rank order; each rank builds every start state and keeps its
    # own, so its result depends on the whole gather (see the module docstring).
    summaries = all_gather(summary[None], group, dim=0)  # [cp, B, H, K, K + V]
    state = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    starts = [state]
    for P, Q in zip(*summaries[:-1].split([K, V], dim=-1)):
        state = P @ state + Q
        starts.append(state)
    state = torch.stack(starts)[dist.get_rank(group)]
    return (o_zero + torch.einsum("bthk,bhkv->bthv", o_start, state)).to(q.dtype)
