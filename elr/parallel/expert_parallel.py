"""Expert parallelism: each rank of an expert-parallel group owns E / ep whole experts of every MoE layer.

Routing stays local (each rank routes its own tokens over all E experts and sorts the (token, expert)
rows by expert, as without EP). The sorted rows then travel to the ranks owning their experts, in
`dispatch_combine`:

    counts    all-to-all of the per-expert row counts, on the device
    sizes     one host read of the send and receive sizes: all_to_all_single takes its split sizes
              as Python ints, so every MoE call syncs the host once (accepted: the alternative, a
              fixed capacity per expert, drops or pads tokens and changes the model)
    dispatch  all-to-all of the rows; regroup the received rows by local expert
    compute   the grouped GEMM of elr/models/experts.py on this rank's experts
    combine   undo the regrouping; the reverse all-to-all brings every row back to its token's rank

Both all-to-alls are differentiable (torch.distributed._functional_collectives), so backward sends
the gradients back the same way. Every rank of a group must make the same MoE calls in the same
order: ranks of one group run the same loop count k (elr/train/loop_sampler.py).

Under tensor or context parallelism each TP/CP position routes its own slice of the sequences and
has its own expert groups (elr/parallel/parallel_dims.py), so its rows never leave that position.

Expert weights become DTensors on the ep mesh with placements [Replicate(), Shard(0)] (copies across
groups and TP/CP positions, split by expert within a group): checkpoints hold the canonical [E, ...]
stacks, so they load at any expert-parallel degree or in one process. FSDP and TP leave them alone
(FSDP's ignored_params; TP's MoE plan covers the router and the shared expert only), and
`reduce_expert_gradients` gives their gradients the reduction FSDP gives the dense ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from elr.models.experts import grouped_experts
from elr.models.ffn import MoE


def dispatch_combine(
    rows: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Run expert-sorted rows [M, dim] (group ends `offsets` over all E experts) on the ranks that own
    their experts; w1 [E/ep, hidden, dim] and w2 [E/ep, dim, hidden] are this rank's experts, the
    rank's position in `group` naming which. Returns the experts' outputs in the order of `rows`."""
    n_ranks, local_experts = dist.get_world_size(group), w1.shape[0]
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())  # rows per expert, [E]
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    received_counts = received_counts.view(n_ranks, local_experts)  # [source rank, local expert]
    send_sizes, receive_sizes = torch.stack(
        [counts.view(n_ranks, local_experts).sum(1), received_counts.sum(1)]
    ).tolist()  # the one host sync of the layer
    received = all_to_all_single_autograd(rows, receive_sizes, send_sizes, group)

    # Rows arrive grouped by source rank, then expert; the grouped GEMM wants them by expert alone.
    expert_of_row = (
        torch.arange(local_experts, device=rows.device)
        .repeat(n_ranks)
        .repeat_interleave(received_counts.flatten(), output_size=sum(receive_sizes))
    )
    regroup = expert_of_row.argsort(stable=True)
    local_offsets = received_counts.sum(0).cumsum(0).to(torch.int32)
    out = grouped_experts(received[regroup], w1, w2, local_offsets)
    out = torch.empty_like(out).index_copy(0, regroup, out)  # back to arrival order
    return all_to_all_single_autograd(out, send_sizes, receive_sizes, group)


class ExpertParallel:
    """The MoE hook (`MoE.expert_parallel`): this rank's experts, reached through the group's all-to-alls."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, rows: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        # FSDP's mixed precision casts only the parameters it manages: cast the local experts here.
        w1, w2 = (w.to_local().to(rows.dtype) for w in (w1, w2))
        return dispatch_combine(rows, offsets, w1, w2, self.group)


def expert_weights(model: nn.Module) -> list[nn.Parameter]:
    """The expert stacks that expert parallelism has split (empty without EP)."""
    return [w for m in model.modules() if getattr(m, "expert_parallel", None) is not None for w in (m.w1, m.w2)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Split every MoE's expert stacks by expert over the ep mesh and route its rows through the
    all-to-alls; returns the split weights (FSDP must ignore them). Works on the meta device."""
    group = ep_mesh.get_group("ep")
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        for name in ("w1", "w2"):
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(distribute_tensor(full.data, ep_mesh, [Replicate(), Shard(0)])))
        moe.expert_parallel = ExpertParallel(group)
    return expert_weights(model)


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, ep_mesh: DeviceMesh, averaged_ranks: int) -> None:
    """Reduce expert gradients as FSDP reduces the dense ones, once per optimizer update.

    An owner's gradient already sums what every rank of its group sent it (the all-to-all backward).
    Summing the copies over ep_replicate (the other groups and every TP/CP position) and dividing by
    `averaged_ranks`, the ranks FSDP averages over (data-parallel x context-parallel: each CP rank's
    loss is normalised by its own tokens), gives FSDP's reduction: a mean over those ranks and a sum
    of the TP positions' partial gradients (each TP rank's tokens are a slice of the same sequences).
    """
    replicas = ep_mesh.get_group("ep_replicate") if ep_mesh.size(0) > 1 else None
    for weight in expert_weights(model):
        if weight.grad is None:
            continue
        grad = weight.grad.to_local()
        grad.div_(averaged_ranks)
        if replicas is not None:
            dist.all_reduce(grad, group=replicas)
