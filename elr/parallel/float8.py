"""Float8 training (torchao, tensor-wise dynamic scales) with the single process's scales under TP.

A float8 cast scales a tensor by 448 / amax (e4m3) or 57344 / amax (e5m2 gradients), amax over the
whole tensor. Under tensor parallelism two kinds of float8 linear run:

    dense FF w1/w2/w3  weights and inputs are DTensors (ColwiseParallel / RowwiseParallel): torchao's
                       amax of a sharded DTensor is reduced over the TP group by DTensor itself
    attention, GDP,    LocalCompute hands the linear plain local views: this rank's rows of the
    MoE shared expert  weight, its heads' inputs or gradients, its slice of the sequence

For the second kind `TensorParallelFloat8Linear` all-reduces (MAX) every amax over the TP group:
the ranks' views together cover the whole tensor (a split, or a replicated copy), so each amax, and
so each float8 value, is the one process's. Our choice, over per-shard scales: the TP run then
computes the same float8 numbers as one process at any TP degree (tests/distributed/tp_float8.py),
for three scalar all-reduces per linear and pass.

The dense FF keeps the plain ColwiseParallel / RowwiseParallel styles: torchao's float8 styles
all-gather the input in float8, which gloo refuses ("Invalid scalar type", measured); gathering in
the compute dtype and casting after gives the same float8 values (the amax is global either way).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole


def to_float8(x: torch.Tensor, dtype: torch.dtype, module: Float8Linear, role: GemmInputRole, mesh: DeviceMesh):
    """x in float8 (autograd passes its gradient through), scaled by the amax over the TP group."""
    return hp_tensor_to_float8_dynamic(x, dtype, module.linear_mm_config, reduce_amax=True, gemm_input_role=role,
                                       device_mesh=mesh, round_scales_to_power_of_2=module.config.round_scales_to_power_of_2)


@torch._dynamo.allow_in_graph
class _GradToFloat8(torch.autograd.Function):
    """Identity forward; backward casts the incoming gradient with the TP group's amax, so the
    matmul's backward takes it as already cast."""

    @staticmethod
    def forward(ctx, output, module, mesh):
        ctx.module, ctx.mesh = module, mesh
        return output

    @staticmethod
    def backward(ctx, grad):
        dtype = ctx.module.config.cast_config_grad_output.target_dtype
        return to_float8(grad, dtype, ctx.module, GemmInputRole.GRAD_OUTPUT, ctx.mesh), None, None


class TensorParallelFloat8Linear(Float8Linear):
    """Float8Linear that, given plain local views under TP, scales with amaxes all-reduced over `tp_mesh`."""

    tp_mesh: DeviceMesh

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):  # a DTensor plan (dense FF): DTensor reduces the amax
            return super().forward(input)
        c = self.config
        x = to_float8(input, c.cast_config_input.target_dtype, self, GemmInputRole.INPUT, self.tp_mesh)
        w = to_float8(self.weight, c.cast_config_weight.target_dtype, self, GemmInputRole.WEIGHT, self.tp_mesh)
        output = _GradToFloat8.apply(matmul_with_hp_or_float8_args.apply(x, w.t(), self.linear_mm_config, c),
                                     self, self.tp_mesh)
        return output if self.bias is None else output + self.bias.to(output.dtype)
