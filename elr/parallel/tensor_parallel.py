"""Tensor + sequence parallelism (TP/SP) for every layer kind, as DTensor `parallelize_module` plans.

Between sublayers the residual stream is a plain tensor holding this rank's slice of the sequence,
[B, T / tp, dim] (sequence parallel): norms, FiLM, the ELR update and the MoE run on that slice. A
mixer or dense feed-forward all-gathers the sequence, runs this rank's heads (or hidden slice) with
local weights, and reduce-scatters its partial output back to sequence slices. Per layer kind:

    embedding          vocab rows split (RowwiseParallel), output reduce-scattered to sequence slices
    norms              SequenceParallel (replicated weight, per-slice compute)
    attention          q/k/v split by heads, o by its input rows; GQA kv heads split when tp divides
                       them, else replicated and each rank keeps the one kv head its q heads read
    GDP                q, k, v, beta, g, a, their convs, A_log and dt_bias split by heads (k, v and
                       beta are laid out head-major, elr/models/gdp.py), o by its input rows
    dense FF           w1/w3 split by hidden rows (colwise), w2 by its input rows (rowwise)
    MoE                (our choice) replicated over TP; each rank routes and computes its own sequence
                       slice, a token-wise layer needing no collective; expert memory is split by
                       expert parallelism, not TP (under EP the expert stacks are DTensors on the ep
                       mesh, not the TP mesh). The balance loss counts routes over the whole sequence
                       (`ELRModel.set_sequence_shards`, called by parallelize)
    ELR step size,     replicated, run on the sequence slice (SP)
    loop conditioning
    output head        vocab columns split; logits stay vocab-sharded for loss_parallel

Every parameter becomes a DTensor on the TP mesh, so FSDP makes them 2-D and checkpoints hold the
canonical (unsplit) layout at any TP degree. Replicated parameters used on one rank's heads or
tokens get partial gradients; `reduce_partial_grads` (or FSDP) sums them over the TP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from elr.errors import ConfigError
from elr.models.args import ModelArgs
from elr.models.model import ELRModel


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence (dim 1) from every TP rank's slice; backward reduce-scatters, summing the
    ranks' partial gradients of it."""
    whole = DTensor.from_local(x, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    return whole.to_local(grad_placements=[Partial()])


@dataclass(frozen=True)
class Rows:
    """A replicated weight of which this rank computes some rows: viewed as [groups, rows per group,
    ...], group `rank * groups // tp` (GQA kv heads fewer than the TP degree)."""

    groups: int


class LocalCompute(ParallelStyle):
    """Run a module on plain local tensors, its parameters held as DTensors on the TP mesh.

    `placements` maps parameter names (relative to the module) to Shard(d) or Rows; the rest are
    replicated. gather=True: the module sees the whole sequence (all-gathered from the slices) and
    its partial output is reduce-scattered back; gather=False: a token-wise module on the rank's
    slice as is. During forward each parameter name resolves to its local view (instance
    attributes shadow nn.Module's parameter lookup), so the model code stays single-device.
    """

    def __init__(self, placements: dict[str, Placement | Rows] | None = None, gather: bool = True):
        super().__init__()
        self.placements = placements or {}
        self.gather = gather

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for prefix, owner in module.named_modules():
            for name, param in list(owner._parameters.items()):
                if param is None:
                    continue
                rule = self.placements.get(f"{prefix}.{name}" if prefix else name, Replicate())
                placement = rule if isinstance(rule, Shard) else Replicate()
                owner.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement])))
        module.register_forward_pre_hook(partial(self._enter, mesh))
        module.register_forward_hook(partial(self._exit, mesh))
        return module

    def _local_view(self, param: DTensor, rule, mesh: DeviceMesh) -> torch.Tensor:
        if isinstance(rule, Shard):
            return param.to_local()
        local = param.to_local(grad_placements=[Partial()])  # this rank's heads or tokens only
        if isinstance(rule, Rows):
            rank, tp = mesh.get_local_rank(), mesh.size()
            local = local.view(rule.groups, -1, *local.shape[1:])[rank * rule.groups // tp]
        return local

    def _enter(self, mesh: DeviceMesh, module: nn.Module, args: tuple):
        for prefix, owner in module.named_modules():
            for name, param in owner._parameters.items():
                if param is not None:
                    rule = self.placements.get(f"{prefix}.{name}" if prefix else name)
                    owner.__dict__[name] = self._local_view(param, rule, mesh)
        if self.gather:
            args = (gather_sequence(args[0], mesh), *args[1:])
        return args

    def _exit(self, mesh: DeviceMesh, module: nn.Module, args: tuple, output):
        for _, owner in module.named_modules():
            for name in owner._parameters:
                owner.__dict__.pop(name, None)
        if self.gather:
            output = DTensor.from_local(output, mesh, [Partial()]).redistribute(mesh, [Shard(1)]).to_local()
        return output


def check_tensor_parallel(args: ModelArgs, tp: int) -> None:
    """Refuse layouts TP cannot split evenly, before any weight exists; one line naming the key."""
    if tp == 1:
        return
    kinds = set(args.layer_pattern)
    needs = {}  # the vocabulary may split unevenly: DTensor pads the last shard
    if "A" in kinds:
        needs["attention heads"] = args.n_heads
        if args.n_kv_heads >= tp:
            needs["attention kv heads"] = args.n_kv_heads
        elif tp % args.n_kv_heads:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree: {tp} must be a multiple of the {args.n_kv_heads} attention "
                "kv heads when it exceeds them (each rank keeps one replicated kv head)"
            )
    if "G" in kinds:
        needs["GDP heads"] = args.gdp_heads
    if "F" in kinds:
        needs["feed-forward hidden size"] = args.ffn_dim
    for what, size in needs.items():
        if size % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} does not divide the {size} {what}")


def sublayer_plan(kind: str, args: ModelArgs, tp: int, experts_elsewhere: bool = False) -> dict[str, ParallelStyle]:
    """The plan of one sublayer of kind G, A, F or E, keyed by submodule ("" is the sublayer itself)."""
    if kind == "A":
        kv = Shard(0) if args.n_kv_heads >= tp else Rows(args.n_kv_heads)
        return {"": LocalCompute({"wq.weight": Shard(0), "wk.weight": kv, "wv.weight": kv, "wo.weight": Shard(1)})}
    if kind == "G":
        by_head = [f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "a_proj",
                                                 "q_conv", "k_conv", "v_conv")] + ["A_log", "dt_bias"]
        return {"": LocalCompute({**dict.fromkeys(by_head, Shard(0)), "o_proj.weight": Shard(1)})}
    if kind == "F":
        plan = {"": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "w1": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Shard(1))}
        if args.ffn_activation == "swiglu":
            plan["w3"] = ColwiseParallel()
        return plan
    if experts_elsewhere:  # MoE under EP: the expert stacks w1/w2 go to the ep mesh (expert_parallel.py)
        names = ["router", "shared"] if args.moe_shared_dim else ["router"]
        return {name: LocalCompute(gather=False) for name in names}
    return {"": LocalCompute(gather=False)}  # MoE: replicated, on the rank's sequence slice


def apply_tensor_parallel(model: ELRModel, mesh: DeviceMesh, experts_elsewhere: bool = False) -> None:
    """Split every layer over the TP mesh (in place, on the meta device or not). experts_elsewhere:
    expert parallelism places the MoE expert stacks on its own mesh; TP leaves them plain."""
    args, tp = model.args, mesh.size()
    check_tensor_parallel(args, tp)
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(use_local_output=True),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    # The embedding's reduce-scatter hands back an AsyncCollectiveTensor; a compiled first layer takes
    # it as a plain input and its backward is lost (measured), so materialise it: one copy of a slice.
    model.tok_embeddings.register_forward_hook(lambda module, args, output: output.clone())
    for layer in model.layers():
        plan = {"norm": SequenceParallel(use_local_output=True)}
        plan.update({f"sublayer.{name}" if name else "sublayer": style
                     for name, style in sublayer_plan(layer.kind, args, tp, experts_elsewhere).items()})
        parallelize_module(layer, mesh, plan)
    for name in ("step_size", "conditioning"):
        if getattr(model.recurrent, name) is not None:
            parallelize_module(model.recurrent, mesh, {name: LocalCompute(gather=False)})


def reduce_partial_grads(model: nn.Module) -> None:
    """Sum the partial gradients of replicated parameters over the TP group (without FSDP, which
    does it in its own reduction); after this every gradient has its parameter's placements."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
