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
for scalar all-reduces: two per linear in forward (input, weight), one in backward (gradient).

The dense FF keeps the plain ColwiseParallel / RowwiseParallel styles: torchao's float8 styles
all-gather the input in float8, which gloo refuses ("Invalid scalar type", measured); gathering in
the compute dtype and casting after gives the same float8 values (the amax is global either way).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import amax_to_scale


def to_float8(
    x: torch.Tensor, dtype: torch.dtype, mm_config: LinearMMConfig, role: GemmInputRole, group: str, power_of_2: bool
):
    """x in float8 (autograd passes its gradient through), scaled by its amax over the TP group."""
    with torch.no_grad():
        amax = funcol.all_reduce(torch.max(torch.abs(x)), "max", group)
        scale = amax_to_scale(
            amax.wait() if isinstance(amax, funcol.AsyncCollectiveTensor) else amax, dtype, power_of_2
        )
    return hp_tensor_and_scale_to_float8(x, scale, dtype, mm_config, role)


@torch._dynamo.allow_in_graph
class _GradToFloat8(torch.autograd.Function):
    """Identity forward; backward casts the incoming gradient with the TP group's amax, so the
    matmul's backward takes it as already cast. Its arguments are constants dynamo can put in a
    graph (no module, no mesh): a graph break here would hand a compiled graph a float8 tangent."""

    @staticmethod
    def forward(ctx, output, dtype, mm_config, group, power_of_2):
        ctx.args = dtype, mm_config, GemmInputRole.GRAD_OUTPUT, group, power_of_2
        return output

    @staticmethod
    def backward(ctx, grad):
        return to_float8(grad, *ctx.args), None, None, None, None


class TensorParallelFloat8Linear(Float8Linear):
    """Float8Linear that, given plain local views under TP, scales with amaxes all-reduced over `tp_mesh`."""

    tp_mesh: DeviceMesh

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):  # a DTensor plan (dense FF): DTensor reduces the amax
            return super().forward(input)
        c, mm, group = self.config, self.linear_mm_config, self.tp_mesh.get_group().group_name
        pow2 = c.round_scales_to_power_of_2
        x = to_float8(input, c.cast_config_input.target_dtype, mm, GemmInputRole.INPUT, group, pow2)
        w = to_float8(self.weight, c.cast_config_weight.target_dtype, mm, GemmInputRole.WEIGHT, group, pow2)
        output = matmul_with_hp_or_float8_args.apply(x, w.t(), mm, c)
        output = _GradToFloat8.apply(output, c.cast_config_grad_output.target_dtype, mm, group, pow2)
        return output if self.bias is None else output + self.bias.to(output.dtype)
