"""Feed-forward layers: dense SwiGLU / squared-ReLU, and a mixture of experts.

The MoE follows Nemotron 3 Nano's published recipe: sigmoid router scores, an aux-loss-free expert
bias that steers top-k selection only, normalised top-k weights times a routed scale, squared-ReLU
experts and one always-on shared expert. Beside the bias, a sequence-level auxiliary balance loss
(the paper's MoE has one: route replay "removes later-loop auxiliary-loss calculations"; its form
here, DeepSeek-V3's sequence-wise loss, is our choice) is recorded on every training forward; the
trainer adds `moe.aux_loss_coeff` times it to the loss.

Layer kinds F (dense) and E (MoE): the modules, their FLOPs and tensor-parallel splits, registered
in elr/models/layers.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elr.models.args import ModelArgs
from elr.models.experts import grouped_experts, permute_tokens, relu2
from elr.models.kinds import TensorSplit


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation: str):
        super().__init__()
        if activation not in ("swiglu", "relu2"):
            raise ValueError(f"unknown feed-forward activation {activation!r}; use swiglu or relu2")
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False) if activation == "swiglu" else None
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def init_weights(self, out_std: float):
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        if self.w3 is not None:
            nn.init.trunc_normal_(self.w3.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(relu2(self.w1(x)))


def recomputing() -> bool:
    """True while backward re-runs a checkpointed forward in eager mode (compiled AC never re-runs
    side effects), so the MoE load counter counts each routed token once."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int, shards=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, sum_e f_e P_e averaged over sequences (1 when balanced).

    scores [B*T, E] (sigmoid), indices [B*T, top_k] (the chosen experts). Per sequence,
    f_e = E / (top_k T) x (tokens routed to e) and P_e = mean over its tokens of s_e / sum_j s_j.
    Only P carries a gradient, to the router. With each sequence split over several ranks (`shards`,
    MoE.sequence_shards) the counts are summed over them and each rank returns its tokens' share:
    the shares add up to the loss.
    """
    E, top_k = scores.shape[-1], indices.shape[-1]
    scores, indices = scores.view(batch, -1, E), indices.view(batch, -1, top_k)
    counts = torch.zeros(batch, E, device=scores.device).scatter_add_(
        1, indices.flatten(1), torch.ones(indices.flatten(1).shape, device=scores.device)
    )
    P = (scores / scores.sum(-1, keepdim=True)).mean(1)
    seq_len = scores.shape[1]
    if shards is not None:
        counts = shards.sum(counts)
        seq_len *= shards.size
        P = P / shards.size  # this rank's tokens' share of the mean
    f = counts * (E / (top_k * seq_len))
    return (f * P).sum(-1).mean()


class Route:
    """A route-replay holder (MoE.forward's `route`): empty until loop 1 routes, then (indices, weights).

    Not a dict: wrappers that map over a layer's inputs (FSDP2 casting them when each recurrent layer
    is its own unit) rebuild dicts, and routes stored in the copy would be lost. It keeps the dict
    calls MoE and the activation-checkpoint wrapper make (truth, update, item access).
    """

    def __init__(self):
        self.indices: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return self.indices is not None

    def update(self, indices: torch.Tensor, weights: torch.Tensor) -> None:
        self.indices, self.weights = indices, weights

    def __getitem__(self, key: str) -> torch.Tensor:
        return {"indices": self.indices, "weights": self.weights}[key]


class MoE(nn.Module):
    """Routed squared-ReLU experts plus a shared expert.

    `route` is the recurrence's replay holder: None routes every call; an empty `Route` routes and
    stores (indices, weights) in it; a filled one reuses them, so later loops neither re-route,
    nor count towards the load that moves the expert bias, nor add a balance loss.
    In training, `aux_loss` sums `sequence_balance_loss` over this forward's routing calls (the
    model clears it at the start of each forward).
    `expert_parallel` is set by elr/parallel/expert_parallel.py when this rank owns only some experts:
    it then runs the expert-sorted rows on their owners' ranks instead of the local grouped GEMM.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, dim, hidden = args.moe_experts, args.dim, args.moe_expert_dim
        self.top_k, self.routed_scale = args.moe_top_k, args.moe_routed_scale
        self.router = nn.Linear(dim, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(E, dim, hidden))
        self.shared = FeedForward(dim, args.moe_shared_dim, "relu2") if args.moe_shared_dim else None
        # The bias only shifts which experts win; it is moved by load, not by gradients
        # (update_expert_biases in elr/train/optimizer.py, once per optimizer step).
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.expert_parallel = None
        self.sequence_shards = None  # the ranks each sequence is split over (TP / CP): a hook from elr/parallel

    def init_weights(self, out_std: float):
        nn.init.trunc_normal_(self.router.weight, std=0.02)
        nn.init.trunc_normal_(self.w1, std=0.02)
        nn.init.trunc_normal_(self.w2, std=out_std)
        if self.shared is not None:
            self.shared.init_weights(out_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def choose_experts(self, x: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The router: (indices, weights) [N, top_k] for tokens x [N, dim] of `batch` sequences. In
        training it also counts the load and adds the balance loss of this routing call."""
        scores = torch.sigmoid(self.router(x).float())
        indices = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        weights = weights / weights.sum(-1, keepdim=True) * self.routed_scale
        if self.training:  # evaluation must not move the balance, nor AC recomputation count it twice
            aux = sequence_balance_loss(
                scores, indices, batch, self.sequence_shards
            )  # recomputed too: its backward needs it
            if not recomputing():
                with torch.no_grad():
                    # index_add_, not bincount: CUDA's bincount reads the max index on the host to size its output
                    self.tokens_per_expert.index_add_(
                        0, indices.flatten(), self.tokens_per_expert.new_ones(indices.numel())
                    )
                self.aux_loss = aux if self.aux_loss is None else self.aux_loss + aux
        return indices, weights

    def forward(self, x: torch.Tensor, route: Route | None = None) -> torch.Tensor:
        B, T, dim = x.shape
        x = x.reshape(-1, dim)
        if route:
            indices, weights = route["indices"], route["weights"]
        else:
            indices, weights = self.choose_experts(x, B)
            if route is not None:
                route.update(indices=indices, weights=weights)

        # Sort the (token, expert) pairs by expert and run every expert in one grouped GEMM each way.
        order, token_of, offsets = permute_tokens(indices, self.w1.shape[0])
        routed = self.run_experts(x[token_of], offsets)
        routed = routed * weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, routed)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(B, T, dim)

    def run_experts(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Every routed expert on expert-sorted rows (group ends `offsets`), outputs in the same order."""
        if self.expert_parallel is not None:
            return self.expert_parallel(rows, offsets, self.w1, self.w2)
        return grouped_experts(rows, self.w1, self.w2, offsets)


def dense_feed_forward(a: ModelArgs) -> FeedForward:
    return FeedForward(a.dim, a.ffn_dim, a.ffn_activation)


def dense_flops(a: ModelArgs, seq_len: int) -> int:
    return 6 * a.dim * a.ffn_dim * (3 if a.ffn_activation == "swiglu" else 2)


def dense_split(a: ModelArgs, tp: int) -> TensorSplit:
    """w1/w3 split by hidden rows (colwise), w2 by its input rows (rowwise)."""
    weights = {"w1.weight": 0, "w2.weight": 1, **({"w3.weight": 0} if a.ffn_activation == "swiglu" else {})}
    return TensorSplit("hidden", weights, divides={"feed-forward hidden size": a.ffn_dim})


def moe_flops(a: ModelArgs, seq_len: int) -> int:
    """The router, top_k routed experts and the shared expert per token."""
    return 6 * a.dim * (a.moe_experts + 2 * a.moe_top_k * a.moe_expert_dim + 2 * a.moe_shared_dim)


def moe_split(a: ModelArgs, tp: int) -> TensorSplit:
    """Replicated over TP, each rank routing and computing its own slice of the sequence (our
    choice): expert memory is split by expert parallelism, which takes the stacks w1/w2."""
    return TensorSplit("tokens", expert_stacks=("w1", "w2"))
