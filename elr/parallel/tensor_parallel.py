"""Tensor + sequence parallelism (TP/SP) for every layer kind, as DTensor `parallelize_module` plans.

Between sublayers the residual stream is a plain tensor holding this rank's slice of the sequence,
[B, T / tp, dim] (sequence parallel): norms, FiLM, the ELR update and the MoE run on that slice. A
mixer or dense feed-forward all-gathers the sequence, runs this rank's heads (or hidden slice) with
local weights, and reduce-scatters its partial output back to sequence slices. Each layer kind says
how in its `TensorSplit` (elr/models/kinds.py; registered in elr/models/layers.py); today's kinds:

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
    loop conditioning,
    input adapter,
    state norm
    output head        vocab columns split; logits stay vocab-sharded for loss_parallel

Every parameter becomes a DTensor on the TP mesh, so FSDP makes them 2-D and checkpoints hold the
canonical (unsplit) layout at any TP degree. Replicated parameters used on one rank's heads or
tokens get partial gradients; `reduce_partial_grads` (or FSDP) sums them over the TP group.
"""

from __future__ import annotations

import logging
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

from elr.models.kinds import Rows, TensorSplit
from elr.models.layers import LAYER_KINDS, check_tensor_parallel
from elr.models.model import ELRModel

logger = logging.getLogger("elr")
# The recurrent block's token-wise modules (each optional): replicated, run on the rank's sequence slice.
RECURRENT_TOKEN_WISE = ("step_size", "conditioning", "input_adapter", "state_norm", "loop_gates", "loop_deltas")


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence (dim 1) from every TP rank's slice; backward reduce-scatters, summing the
    ranks' partial gradients of it."""
    whole = DTensor.from_local(x, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    return whole.to_local(grad_placements=[Partial()])


class LocalCompute(ParallelStyle):
    """Run a module on plain local tensors, its parameters held as DTensors on the TP mesh.

    `placements` maps parameter names (relative to the module) to Shard(d) or Rows; the rest are
    replicated, except those in `leave` (expert stacks another mesh holds), which stay as they are.
    gather=True: the module sees the whole sequence (all-gathered from the slices) and its partial
    output is reduce-scattered back; gather=False: a token-wise module on the rank's slice as is.
    During forward each parameter name resolves to its local view (instance attributes shadow
    nn.Module's parameter lookup), so the model code stays single-device.
    """

    def __init__(
        self, placements: dict[str, Placement | Rows] | None = None, gather: bool = True, leave: tuple[str, ...] = ()
    ):
        super().__init__()
        self.placements = placements or {}
        self.gather = gather
        self.leave = set(leave)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for prefix, owner in module.named_modules():
            for name, param in list(owner._parameters.items()):
                if param is None or self._left(prefix, name):
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

    def _left(self, prefix: str, name: str) -> bool:
        return (f"{prefix}.{name}" if prefix else name) in self.leave

    def _enter(self, mesh: DeviceMesh, module: nn.Module, args: tuple):
        for prefix, owner in module.named_modules():
            for name, param in owner._parameters.items():
                if param is not None and not self._left(prefix, name):
                    rule = self.placements.get(f"{prefix}.{name}" if prefix else name)
                    owner.__dict__[name] = self._local_view(param, rule, mesh)
        if self.gather:
            args = (gather_sequence(args[0], mesh), *args[1:])
        return args

    def _exit(self, mesh: DeviceMesh, module: nn.Module, args: tuple, output):
        for prefix, owner in module.named_modules():
            for name in owner._parameters:
                if not self._left(prefix, name):
                    owner.__dict__.pop(name, None)
        if self.gather:
            output = DTensor.from_local(output, mesh, [Partial()]).redistribute(mesh, [Shard(1)]).to_local()
        return output


def sublayer_plan(split: TensorSplit, experts_elsewhere: bool = False) -> dict[str, ParallelStyle]:
    """The plan of one sublayer from its kind's split, keyed by submodule ("" is the sublayer itself).
    experts_elsewhere: expert parallelism holds the split's expert stacks, so TP leaves them alone."""
    if split.how == "heads":
        placements = {name: Shard(dim) if isinstance(dim, int) else dim for name, dim in split.weights.items()}
        return {"": LocalCompute(placements)}
    if split.how == "hidden":  # the DTensor plans keep float8's amax reductions to DTensor (float8.py)
        plan = {"": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
        for name, dim in split.weights.items():
            style = ColwiseParallel() if dim == 0 else RowwiseParallel(output_layouts=Shard(1))
            plan[name.removesuffix(".weight")] = style
        return plan
    if split.how == "tokens":
        return {"": LocalCompute(gather=False, leave=split.expert_stacks if experts_elsewhere else ())}
    raise ValueError(f"unknown tensor split {split.how!r}; use heads, hidden or tokens")


def tensor_parallel_plan(model: ELRModel, tp: int, experts_elsewhere: bool = False) -> dict[str, dict]:
    """The whole plan, resolved from the layer kinds' registry: {scope: {module: style}}, with scopes
    "model" (embedding, final norm, head), "layer <kind>" (one per kind in the pattern: every layer of a
    kind gets the same plan) and "recurrent" (the block's token-wise modules). Checked first: one line
    naming the key if TP cannot split the model evenly."""
    args = model.args
    check_tensor_parallel(args, tp)  # the config's check (elr/models/from_config.py), on the model it splits
    plan = {
        "model": {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(use_local_output=True),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
    }
    for layer in model.layers():
        if f"layer {layer.kind}" not in plan:
            split = LAYER_KINDS[layer.kind].tensor_split(args, tp)
            styles = {"norm": SequenceParallel(use_local_output=True)}
            for name, style in sublayer_plan(split, experts_elsewhere).items():
                styles[f"sublayer.{name}" if name else "sublayer"] = style
            plan[f"layer {layer.kind}"] = styles
    recurrent = {name: LocalCompute(gather=False) for name in RECURRENT_TOKEN_WISE if getattr(model.recurrent, name)}
    if recurrent:
        plan["recurrent"] = recurrent
    return plan


def describe_style(style: ParallelStyle) -> str:
    """One line for a style: its class and the layouts or placements that make it what it is."""
    if isinstance(style, LocalCompute):
        placed = ", ".join(f"{name} {placement}" for name, placement in sorted(style.placements.items()))
        parts = ["gathers the sequence" if style.gather else "on the local slice"]
        parts += [placed] if placed else []
        parts += [f"leaves {', '.join(sorted(style.leave))}"] if style.leave else []
        return f"LocalCompute({'; '.join(parts)})"
    layouts = []
    for attr in ("input_layouts", "output_layouts", "desired_input_layouts", "sequence_sharding"):
        value = getattr(style, attr, None)
        if value is not None:
            layouts.append(f"{attr}={value}")
    if getattr(style, "use_local_output", None) is False:
        layouts.append("use_local_output=False")
    return f"{type(style).__name__}({', '.join(layouts)})"


def describe_plan(plan: dict[str, dict]) -> list[str]:
    """The plan as lines `scope  module: style`, in a stable order (printed at debug level, pinned by
    tests/test_parallel_plan.py)."""
    return [
        f"{scope:<10} {name}: {describe_style(style)}"
        for scope, styles in plan.items()
        for name, style in styles.items()
    ]


def apply_tensor_parallel(model: ELRModel, mesh: DeviceMesh, experts_elsewhere: bool = False) -> None:
    """Split every layer over the TP mesh (in place, on the meta device or not). experts_elsewhere:
    expert parallelism places the MoE expert stacks on its own mesh; TP leaves them plain."""
    plan = tensor_parallel_plan(model, mesh.size(), experts_elsewhere)
    logger.debug("tensor-parallel plan (tp = %d):\n  %s", mesh.size(), "\n  ".join(describe_plan(plan)))
    parallelize_module(model, mesh, plan["model"])
    # The embedding's reduce-scatter hands back an AsyncCollectiveTensor; a compiled first layer takes
    # it as a plain input and its backward is lost (measured), so materialise it: one copy of a slice.
    model.tok_embeddings.register_forward_hook(lambda module, args, output: output.clone())
    for layer in model.layers():
        parallelize_module(layer, mesh, plan[f"layer {layer.kind}"])
    for name, style in plan.get("recurrent", {}).items():
        parallelize_module(model.recurrent, mesh, {name: style})


def reduce_partial_grads(model: nn.Module) -> None:
    """Sum the partial gradients of replicated parameters over the TP group (without FSDP, which
    does it in its own reduction); after this every gradient has its parameter's placements."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
