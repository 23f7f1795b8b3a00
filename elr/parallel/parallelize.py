"""Parallelism in one place: `parallelize(model, dims, cfg)` applies float8, tensor/sequence
parallelism, context parallelism, expert parallelism, activation checkpointing, torch.compile and
FSDP2 to a model built on the meta device, in that order. With TP, FSDP shards over the data-parallel
mesh on top of the TP split (2-D parameters); with CP, over dp_shard x cp.

FSDP units: each input/output layer, the whole recurrent block (its layers together with the
k-loop, called exactly once per microbatch so ranks running different k stay in step), and the
root (embeddings, final norm, head). Recurrent layers are compiled once and reused on every loop.
The block's parameters are anchored (elr/parallel/gradient_anchor.py): each gets a gradient, zeros
where a rank's k left it unused, so every rank reduce-scatters the same tensors.
When all ranks run the same k (one data-parallel rank split by CP/TP alone, or one expert group
spanning every data-parallel rank), each recurrent layer becomes its own unit instead, gathered k
times per microbatch (tests/distributed/expert_parallel_ops.py checks a unit called k times against
one process): the unsharded peak is one layer, not the whole block (2.35B dense parameters at
30B-A3B). Expert weights split by expert parallelism stay out of FSDP. A weight TP splits unevenly
along dim 0 is FSDP-sharded along dim 1 (`fsdp_shard_dim`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from elr.config import JobConfig
from elr.models.model import ELRModel
from elr.parallel.activation_checkpoint import apply_activation_checkpointing
from elr.parallel.context_parallel import enable_context_parallel
from elr.parallel.expert_parallel import apply_expert_parallel
from elr.parallel.gradient_anchor import anchor_parameters
from elr.parallel.parallel_dims import ParallelDims
from elr.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: ELRModel, dims: ParallelDims, cfg: JobConfig, device_type: str) -> None:
    """float8 -> TP -> CP -> EP -> activation checkpointing -> compile -> FSDP2 (each when enabled).

    float8 swaps linear modules, so it comes before TP, whose dense feed-forward plan hooks the
    module instances; TP before AC and compile, so the layers AC wraps and compile traces are
    already split; AC wraps each layer before compile so the checkpoint regions are traced into the
    compiled layer; FSDP comes last so its units hold the wrapped, compiled layers.
    """
    if cfg.float8.enable:
        convert_to_float8(model, emulate=device_type != "cuda", tp_mesh=dims.tp_mesh)
    if dims.tp_mesh is not None:
        apply_tensor_parallel(model, dims.tp_mesh, experts_elsewhere=dims.ep_mesh is not None)
    if dims.cp_mesh is not None:
        enable_context_parallel(model, dims.cp_mesh)
    if dims.sequence_mesh is not None:
        model.set_sequence_shards(SequenceShards(dims.sequence_mesh.get_group()))
    expert_weights = apply_expert_parallel(model, dims.ep_mesh) if dims.ep_mesh is not None else []
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.selective_ac_option)
    if cfg.compile.enable:
        # Static shapes under TP: dynamic ones fail on DTensor norms in our torch ("unhashable type:
        # non-nested SymInt", measured on CPU).
        compile_layers(model, dynamic=False if dims.tp_mesh is not None else None)
    if dims.fsdp_mesh is not None:
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            getattr(torch, cfg.training.mixed_precision_param),
            ignored=set(expert_weights),
            recurrent_per_layer=dims.loops_shared_by_all,
        )


class SequenceShards:
    """The hook of the ranks each sequence is split over (TP and/or CP; `ELRModel.set_sequence_shards`):
    the MoE balance loss counts routes over whole sequences and the per-loop statistics describe whole
    sequences, so both sum over these ranks. Their slices are of equal size."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (a collective: every rank of the group calls it)."""
        dist.all_reduce(x, group=self.group)
        return x


# The roles (ELRModel.parameter_roles) of the linear weights float8 takes: not the head, the MoE router
# or the small ELR heads (step size, conditioning), which are cheap and precision-sensitive.
FLOAT8_ROLES = ("matrix", "gate")


def convert_to_float8(model: ELRModel, emulate: bool, tp_mesh: DeviceMesh | None = None) -> int:
    """Swap the large linear layers for torchao Float8Linear; returns how many were converted.

    The head, the MoE router and the small ELR heads stay in high precision: they are cheap and
    precision-sensitive. emulate=True runs the float8 casts on hardware without float8 matmuls.
    With a TP mesh (before TP is applied) they become TensorParallelFloat8Linear, whose scales are
    the single process's under TP (elr/parallel/float8.py).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from elr.parallel.float8 import TensorParallelFloat8Linear

    roles = model.parameter_roles()

    def wanted(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and roles.get(f"{fqn}.weight") in FLOAT8_ROLES
        )

    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate), module_filter_fn=wanted)
    if tp_mesh is not None:
        for module in model.modules():
            if type(module) is Float8Linear:  # re-classed in place, as fully_shard does
                module.__class__, module.tp_mesh = TensorParallelFloat8Linear, tp_mesh
    return before - sum(type(m) is nn.Linear for m in model.modules())


def compile_layers(model: ELRModel, dynamic: bool | None = None) -> None:
    for layer in model.layers():
        layer.compile(dynamic=dynamic)


def apply_fsdp(
    model: ELRModel,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    ignored: set[nn.Parameter] = frozenset(),
    recurrent_per_layer: bool = False,
) -> None:
    """recurrent_per_layer: only when every rank runs the same k (a unit must be called equally often
    on every rank of its mesh)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, mp_policy=policy, ignored_params=set(ignored) or None, shard_placement_fn=fsdp_shard_dim)
    if not recurrent_per_layer:  # ranks may run different k: every block parameter gets a gradient on each
        anchor_parameters(model.recurrent)
    recurrent = list(model.recurrent.layers) if recurrent_per_layer else [model.recurrent]
    for unit in [*model.input_layers, *recurrent, *model.output_layers]:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)


def fsdp_shard_dim(param: nn.Parameter) -> Shard:
    """FSDP shards dim 0, except for a weight TP split unevenly along dim 0 (a vocabulary not a
    multiple of the TP degree, as the embedding and head are): FSDP shards its dim 1 instead. Sharding
    an uneven TP shard again along dim 0 makes DCP save overlapping chunks (measured: FSDP 4 x TP 2,
    8193 ids; loading then restores wrong rows), so the two splits are kept on different dims."""
    if isinstance(param, DTensor) and param.ndim == 2:
        tp_split = [pl.dim for pl in param.placements if isinstance(pl, Shard)]
        if tp_split == [0] and param.shape[0] % param.device_mesh.size():
            return Shard(1)
    return Shard(0)
