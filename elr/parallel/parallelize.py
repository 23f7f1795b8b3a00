"""Apply float8, torch.compile and FSDP2 to a model built on the meta device, in that order.

FSDP units: each input/output layer, the whole recurrent block (its layers together with the
k-loop, called exactly once per microbatch so ranks running different k stay in step), and the
root (embeddings, final norm, head). Recurrent layers are compiled once and reused on every loop.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from elr.models.model import ELRModel


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


def compile_layers(model: ELRModel) -> None:
    for layer in [*model.input_layers, *model.recurrent.layers, *model.output_layers]:
        layer.compile()


def apply_fsdp(model: ELRModel, mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in [*model.input_layers, *model.output_layers]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model.recurrent, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
