"""Gated DeltaProduct mixer (docs/DESIGN.md §3.2): projections, short convolutions, gates, output norm.

The recurrence itself lives in kernels/elr_kernels/gated_delta_product; this layer only prepares its inputs:
L2-normalised q and k after causal depthwise convolutions, beta = 2 sigmoid(.) so the Householder
factors may have negative eigenvalues, and a Mamba-style log decay g = -exp(A_log) softplus(.).

The n_h keys, values and betas of a token are laid out head-major in their projections, (H, n_h, D)
and (H, n_h): each head owns one contiguous block of rows, so tensor parallelism splits every
projection and convolution by heads with a plain row split, and a checkpoint has one layout at any
TP degree (our choice; the kernel's step-major order costs no extra copy: the reshape after the
convolution copies in either order). Checkpoints before format 2 hold the old order (`HEAD_MAJOR`).

Layer kind G: the module, its FLOPs, its tensor-parallel split, its inference cache entry (state and
short-conv tails) and its weight layout, registered in elr/models/layers.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elr.models.args import ModelArgs
from elr.models.cache import Cache
from elr.models.kinds import TensorSplit, WeightLayout
from elr_kernels.gated_delta_product import gated_delta_product, gated_delta_product_step

# Chunks up to this many columns (a decoded token, self-speculative drafts) convolve as window sums, as
# packed documents do: one library convolution call costs more than the whole sum at that size, eager or
# compiled (where the sum is one fused elementwise kernel).
WINDOWED_CONV_COLUMNS = 16


class ShortConv(nn.Module):
    """Causal depthwise convolution over time followed by SiLU.

    `state` holds the previous kernel_size - 1 inputs [B, kernel_size - 1, C] (zeros at the start
    of a sequence); forward also returns the last kernel_size - 1 inputs, the next chunk's state.
    `positions` [B, T] (each token's position in its document, elr/models/documents.py): a tap that
    would reach back past the token's document start reads zero instead, as if the document ran alone.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def init_weights(self):
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        width = self.weight.shape[-1] - 1
        if state is None:
            state = x.new_zeros(B, width, C)
        x = torch.cat([state.to(x.dtype), x], dim=1)
        if positions is None and T > WINDOWED_CONV_COLUMNS:
            y = F.conv1d(x.transpose(1, 2), self.weight, groups=C)
            return F.silu(y).transpose(1, 2), x[:, x.shape[1] - width :]
        # Tap i reads the input width - i tokens back: kept where that is still the token's document.
        y = sum(
            x[:, i : i + T]
            * self.weight[:, 0, i]
            * (1 if positions is None else (positions >= width - i)[..., None].to(x.dtype))
            for i in range(width + 1)
        )
        return F.silu(y), x[:, x.shape[1] - width :]


class GatedDeltaProduct(nn.Module):
    # Context parallelism's hook (elr/parallel/context_parallel.py, which sets it): x is then this rank's
    # slice of each sequence. None: the whole sequence is here.
    context_parallel = None

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

    def forward(self, x: torch.Tensor, cache=None, document_positions: torch.Tensor | None = None) -> torch.Tensor:
        """`cache` (inference only: this layer's GDPState entry, below) carries the recurrent and short-conv state
        from the previous chunk in and this chunk's out; padding positions leave both untouched.
        `document_positions` [B, T] (documents packed into one row, elr/models/documents.py): the state restarts
        from zero at each document start (position 0) and the short convolutions stay inside each document."""
        B, T, _ = x.shape
        D, n_h = self.head_dim, self.n_householder
        H = self.A_log.shape[0]  # under tensor parallelism, this rank's heads
        conv_states = cache.conv_states if cache is not None else (None, None, None)
        if cache is not None:  # padding: zero conv inputs, no decay (g = 0), no update (beta = 0)
            valid = cache.valid[..., None]
            x = x * valid.to(x.dtype)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.context_parallel is not None:  # the previous shard's last inputs start the convolutions
            conv_states = self.context_parallel.conv_states([q, k, v], self.q_conv.weight.shape[-1] - 1)
        q, q_tail = self.q_conv(q, conv_states[0], document_positions)
        k, k_tail = self.k_conv(k, conv_states[1], document_positions)
        v, v_tail = self.v_conv(v, conv_states[2], document_positions)
        resets = document_positions == 0 if document_positions is not None else None
        q = F.normalize(q.reshape(B, T, H, D), dim=-1, eps=1e-6)
        k = F.normalize(k.reshape(B, T, H, n_h, D).transpose(2, 3).reshape(B, T * n_h, H, D), dim=-1, eps=1e-6)
        v = v.reshape(B, T, H, n_h, D).transpose(2, 3).reshape(B, T * n_h, H, D)
        beta = 2 * torch.sigmoid(self.b_proj(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        if cache is not None:
            beta, g = beta * valid, g * valid
        beta = beta.view(B, T, H, n_h).transpose(2, 3).reshape(B, T * n_h, H)
        if self.context_parallel is not None:
            o = self.context_parallel.gated_delta_product(
                q, k, v, g, beta, num_householder=n_h, impl=self.impl, resets=resets
            )
        elif cache is not None and T == 1:  # decoding: the one-token step (the Triton kernel on CUDA)
            o, state = gated_delta_product_step(q, k, v, g, beta, cache.state, num_householder=n_h, impl=self.impl)
        else:
            o, state = gated_delta_product(
                q,
                k,
                v,
                g,
                beta,
                num_householder=n_h,
                impl=self.impl,
                initial_state=cache.state if cache is not None else None,
                output_final_state=cache is not None,
                resets=resets,
            )
        if cache is not None:
            cache.write(state, (q_tail, k_tail, v_tail))
        o = self.o_norm(o) * F.silu(self.g_proj(x)).view(B, T, H, D)
        return self.o_proj(o.reshape(B, T, H * D))


def gdp_flops(a: ModelArgs, seq_len: int) -> int:
    """The projections, and 6 * (2 n_h + 1) * d_k * d_v per head for the state update (the short
    convolutions' 4 multiply-adds per channel are left out)."""
    H, D, n_h = a.gdp_heads, a.gdp_head_dim, a.gdp_householder
    weights = a.dim * (H * D * (3 + 2 * n_h) + H * (1 + n_h))
    state = H * (2 * n_h + 1) * D * D
    return 6 * (weights + state)


def gdp_split(a: ModelArgs, tp: int) -> TensorSplit:
    """Every projection, convolution and per-head parameter split by heads (k, v and beta rows are
    head-major), o by its input rows."""
    by_head = [
        f"{name}.weight"
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "a_proj", "q_conv", "k_conv", "v_conv")
    ] + ["A_log", "dt_bias"]
    return TensorSplit("heads", {**dict.fromkeys(by_head, 0), "o_proj.weight": 1}, divides={"GDP heads": a.gdp_heads})


class GDPState:
    """One GDP layer's inference cache entry (at one loop of a Cache, elr/models/cache.py): the recurrent state
    [B, H, K, V] and the short convolutions' input tails."""

    def __init__(self, mixer: GatedDeltaProduct, cache: Cache, dtype, device):
        self.cache = cache
        B, H, D = cache.batch, mixer.n_heads, mixer.head_dim
        self.state = torch.zeros(B, H, D, D, dtype=dtype, device=device)
        self.conv_states = tuple(
            torch.zeros(B, conv.weight.shape[-1] - 1, conv.weight.shape[0], dtype=dtype, device=device)
            for conv in (mixer.q_conv, mixer.k_conv, mixer.v_conv)
        )
        self.pending = None

    @property
    def valid(self) -> torch.Tensor:
        return self.cache.valid

    def write(self, state: torch.Tensor, conv_states: tuple[torch.Tensor, ...]) -> None:
        """Hold the chunk's final state; it replaces the stored one when the whole forward ends, so
        in last_loop mode every loop of the chunk starts from the previous chunk's final loop. Rows
        the cache marks as past their budget (`cache.rows`) keep what they held."""
        rows = self.cache.rows
        if rows is not None:
            held = self.pending or (self.state, self.conv_states)
            state = torch.where(rows[:, None, None, None], state, held[0].to(state.dtype))
            conv_states = tuple(
                torch.where(rows[:, None, None], new, old.to(new.dtype)) for new, old in zip(conv_states, held[1])
            )
        self.pending = (state, conv_states)

    def commit(self) -> None:
        if self.pending is not None:
            state, conv_states = self.pending
            self.state.copy_(state)
            for dst, src in zip(self.conv_states, conv_states):
                dst.copy_(src)
            self.pending = None

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the committed state: it folds in every column, so a rewind needs them."""
        return [t.clone() for t in self.tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for dst, src in zip(self.tensors(), saved):
            dst.copy_(src)
        self.pending = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.state, *self.conv_states]


def gdp_state_bytes(a: ModelArgs, context_len: int, element_size: int) -> int:
    """One entry for one request, whatever the context: heads x head_dim^2 of state, plus the last
    kernel_size - 1 inputs of the q, k and v convolutions."""
    H, D, n_h = a.gdp_heads, a.gdp_head_dim, a.gdp_householder
    return H * D * D * element_size + (a.gdp_conv_size - 1) * (1 + 2 * n_h) * H * D * element_size


# Checkpoint format 2 (2026-12-01) made the k/v/beta rows head-major.
HEAD_MAJOR = WeightLayout(2, "k_proj", "GDP k/v/beta weights in the row order used before 2026-12-01")
