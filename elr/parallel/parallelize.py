"""Parallelism in one place: `parallelize(model, dims, cfg)` applies tensor/sequence parallelism,
float8, activation checkpointing, torch.compile and FSDP2 to a model built on the meta device, in
that order (context parallelism slots in after TP). With TP, FSDP shards over the data-parallel
mesh on top of the TP split (2-D parameters).

FSDP units: each input/output layer, the whole recurrent block (its layers together with the
k-loop, called exactly once per microbatch so ranks running different k stay in step), and the
root (embeddings, final norm, head). Recurrent layers are compiled once and reused on every loop.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from elr.config import ConfigError, JobConfig
from elr.models.model import ELRModel
from elr.parallel.activation_checkpoint import apply_activation_checkpointing
from elr.parallel.parallel_dims import ParallelDims
from elr.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: ELRModel, dims: ParallelDims, cfg: JobConfig, device_type: str) -> None:
    """TP -> float8 -> activation checkpointing -> compile -> FSDP2 (each when enabled).

    TP first, so the layers AC wraps and compile traces are already split; AC wraps each layer
    before compile so the checkpoint regions are traced into the compiled layer; FSDP comes last so
    its units hold the wrapped, compiled layers.
    """
    if dims.cp > 1:
        raise ConfigError("parallelism.context_parallel_degree: context parallelism is not built yet (issue 8); use 1")
    if dims.tp_mesh is not None:
        apply_tensor_parallel(model, dims.tp_mesh)
    if cfg.float8.enable:
        convert_to_float8(model, emulate=device_type != "cuda")
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.selective_ac_option)
    if cfg.compile.enable:
        # Static shapes under TP: dynamic ones fail on DTensor norms in our torch ("unhashable type:
        # non-nested SymInt", measured on CPU).
        compile_layers(model, dynamic=False if dims.tp_mesh is not None else None)
    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, getattr(torch, cfg.training.mixed_precision_param))


def convert_to_float8(model: ELRModel, emulate: bool) -> int:
    """Swap the large linear layers for torchao Float8Linear; returns how many were converted.

    The head, the MoE router and the small ELR heads stay in high precision: they are cheap and
    precision-sensitive. emulate=True runs the float8 casts on hardware without float8 matmuls.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def wanted(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and fqn != "output"
            and not fqn.endswith("router")
            and ".step_size" not in f".{fqn}"
            and ".conditioning" not in f".{fqn}"
        )

    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate), module_filter_fn=wanted)
    return before - sum(type(m) is nn.Linear for m in model.modules())


def compile_layers(model: ELRModel, dynamic: bool | None = None) -> None:
    for layer in [*model.input_layers, *model.recurrent.layers, *model.output_layers]:
        layer.compile(dynamic=dynamic)


def apply_fsdp(model: ELRModel, mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in [*model.input_layers, *model.output_layers]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model.recurrent, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
