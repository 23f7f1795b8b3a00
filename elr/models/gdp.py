"""Gated DeltaProduct mixer (DESIGN.md §3.2): projections, short convolutions, gates, output norm.

The recurrence itself lives in kernels/gated_delta_product; this layer only prepares its inputs:
L2-normalised q and k after causal depthwise convolutions, beta = 2 sigmoid(.) so the Householder
factors may have negative eigenvalues, and a Mamba-style log decay g = -exp(A_log) softplus(.).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elr.models.args import ModelArgs
from kernels.gated_delta_product import gated_delta_product


class ShortConv(nn.Module):
    """Causal depthwise convolution over time followed by SiLU."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def init_weights(self):
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, C]
        T, C = x.shape[1], x.shape[2]
        y = F.conv1d(x.transpose(1, 2), self.weight, padding=self.weight.shape[-1] - 1, groups=C)
        return F.silu(y[..., :T]).transpose(1, 2)


class GatedDeltaProduct(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H, D, n_h = args.gdp_heads, args.gdp_head_dim, args.gdp_householder
        self.n_heads, self.head_dim, self.n_householder, self.impl = H, D, n_h, args.gdp_impl
        self.q_proj = nn.Linear(args.dim, H * D, bias=False)
        self.k_proj = nn.Linear(args.dim, n_h * H * D, bias=False)
        self.v_proj = nn.Linear(args.dim, n_h * H * D, bias=False)
        self.a_proj = nn.Linear(args.dim, H, bias=False)  # decay rate
        self.b_proj = nn.Linear(args.dim, n_h * H, bias=False)  # Householder strengths beta
        self.g_proj = nn.Linear(args.dim, H * D, bias=False)  # output gate
        self.o_proj = nn.Linear(H * D, args.dim, bias=False)
        self.q_conv = ShortConv(H * D, args.gdp_conv_size)
        self.k_conv = ShortConv(n_h * H * D, args.gdp_conv_size)
        self.v_conv = ShortConv(n_h * H * D, args.gdp_conv_size)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.o_norm = nn.RMSNorm(D, eps=args.norm_eps)

    def init_weights(self, out_std: float):
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj):
            nn.init.trunc_normal_(proj.weight, std=0.02)
        nn.init.trunc_normal_(self.o_proj.weight, std=out_std)
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            conv.init_weights()
        # Decay rates A in [1, 16] and time steps dt in [1e-3, 1e-1], as in Mamba-2.
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.o_norm.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, D, n_h = self.n_heads, self.head_dim, self.n_householder
        q = F.normalize(self.q_conv(self.q_proj(x)).reshape(B, T, H, D), dim=-1, eps=1e-6)
        k = F.normalize(self.k_conv(self.k_proj(x)).reshape(B, T * n_h, H, D), dim=-1, eps=1e-6)
        v = self.v_conv(self.v_proj(x)).reshape(B, T * n_h, H, D)
        beta = 2 * torch.sigmoid(self.b_proj(x).float()).view(B, T * n_h, H)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        o, _ = gated_delta_product(q, k, v, g, beta, num_householder=n_h, impl=self.impl)
        o = self.o_norm(o) * F.silu(self.g_proj(x)).view(B, T, H, D)
        return self.o_proj(o.reshape(B, T, H * D))
