"""The ELR language model: embed -> input block -> k x recurrent block -> output block -> head."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from elr.models.args import ModelArgs
from elr.models.attention import rope_table
from elr.models.budget import LoopBudget, as_loop_budget
from elr.models.cache import Cache
from elr.models.documents import Documents, check_document_ids, document_layout
from elr.models.early_exit import ExitRule
from elr.models.ffn import MoE
from elr.models.gdp import ShortConv
from elr.models.layers import LAYER_KINDS, Layer
from elr.models.recurrence import RecurrentBlock

# What each parameter is, for the code that treats kinds of parameters differently (the optimizer's
# groups and Muon's matrices, the float8 filter, the late switch, inference loading): they ask
# `ELRModel.parameter_roles()` instead of guessing from names.
PARAMETER_ROLES = {
    "embedding": "the token embedding",
    "head": "the output projection to the vocabulary",
    "norm": "RMSNorm scales",
    "matrix": "hidden linear weights and MoE expert stacks (Muon's matrices)",
    "gate": "linear weights that produce per-head gate values (a layer kind's `gates`, e.g. GDP's decay and beta)",
    "router": "the MoE router's weight",
    "conv": "the GDP short convolutions' filters",
    "vector": "biases and other one-dimensional parameters (GDP's A_log, dt_bias)",
    "step_size": "the ELR adaptive step's parameters (elr/models/recurrence.py, AdaptiveStep)",
    "conditioning": "the loop conditioning's embeddings and FiLM heads (LoopConditioning)",
    "loop_gate": "the zero-initialised gates of loops 2..K (`identity_loops`, LoopGates)",
    "loop_delta": "the low-rank deltas of loops 2..K on the recurrent sublayers (`loop_delta_rank`, LoopDeltas)",
}


class ELRModel(nn.Module):
    # Context parallelism's hook (elr/parallel/context_parallel.py, which sets it): tokens are this
    # rank's slice of each sequence, whose RoPE positions it gives. None: the whole sequence is here.
    context_parallel = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        n_in, n_rec, _ = args.partition
        layers = [Layer(kind, args) for kind in args.layer_pattern]
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.input_layers = nn.ModuleList(layers[:n_in])
        self.recurrent = RecurrentBlock(args, layers[n_in : n_in + n_rec])
        self.output_layers = nn.ModuleList(layers[n_in + n_rec :])
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args.rope_dim, args.max_seq_len, args.rope_theta), persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """Materialise every parameter (the model may have been built on the meta device)."""
        a = self.args
        self.rope.copy_(rope_table(a.rope_dim, a.max_seq_len, a.rope_theta))
        nn.init.normal_(self.tok_embeddings.weight)
        for depth, layer in zip(self.init_depths(), self.layers()):
            layer.init_weights(out_std=0.02 / (2 * depth) ** 0.5)
        self.recurrent.init_weights()
        self.norm.reset_parameters()
        cutoff = 3 * a.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=a.dim**-0.5, a=-cutoff, b=cutoff)

    def init_depths(self) -> list[int]:
        """Each layer's depth for its output projections' init std 0.02 / sqrt(2 depth): its 1-based
        position in the stack; with `depth_scaled_init` its position in the stack unrolled to K loops,
        a recurrent layer at its K-th loop (the deepest it runs at) and the output block after all K."""
        n_in, n_rec, n_out = self.args.partition
        r = self.args.recurrence
        unrolled = (r.max_loops - 1) * n_rec if r.depth_scaled_init else 0
        return [d + 1 + (unrolled if d >= n_in else 0) for d in range(n_in + n_rec + n_out)]

    def forward(
        self,
        tokens: torch.Tensor,
        loops: LoopBudget = 1,
        cache: Cache | None = None,
        head: bool = True,
        every_loop: bool = False,
        exit_rule: ExitRule | None = None,
        document_ids: torch.Tensor | None = None,
        loop_exits: bool = False,
    ) -> torch.Tensor:
        """tokens: [B, T] -> logits [B, T, vocab], running the recurrent block `loops` times: an int,
        or a LongTensor [B] of per-row budgets (elr/models/budget.py; each row gets what it gets alone).

        `document_ids` [B, T] (an integer per token; equal neighbours are one document, a change of value
        starts the next): documents packed into one row never see each other, at every loop; each token
        gets what it gets in its document run alone (elr/models/documents.py). None: no masking.

        head=False returns the normed final hidden state [B, T, dim] instead, for a loss that applies
        `self.output` itself a chunk of tokens at a time (elr/train/loss.py). every_loop=True (training,
        a prefix-consistent block) runs the output block on the state after each loop i = 1..k, one
        batch of k x B rows: [k, B, T, ...], the model at every budget up to k in one forward. loop_exits=True
        reads the same exits from any block: with the budget embedding in the loops, exit i is then loop i of this
        k-loop forward (with budget i's exit FiLM), not the model at budget i (elr.loop_consistency's students).

        With `cache` (inference; the interface is elr/models/cache.py's Cache, elr/infer/cache.py builds
        one) `tokens` continue the cached sequences: each row's positions come from the cache, and the
        cache keeps this chunk's keys, values and states. Under context parallelism
        (`context_parallel`) `tokens` are this rank's slice of each sequence.

        `exit_rule` (inference; elr/models/early_exit.py): adaptive depth, `loops` its cap; the loops
        each token ran are then `loops_used()`.
        """
        loops = as_loop_budget(loops, tokens.shape[0], tokens.device)
        every_loop = every_loop or loop_exits
        documents = self.documents(tokens, document_ids, cache)
        rope = self.positions(tokens, loops, cache, documents)
        for moe in self.moe_layers():
            moe.aux_loss = None
        h = self.tok_embeddings(tokens)
        for layer in self.input_layers:
            h = layer(h, rope, cache=cache.entry(layer, 1) if cache is not None else None, documents=documents)
        h, exit_films = self.recurrent(
            h,
            rope,
            loops,
            cache,
            every_loop=every_loop,
            exit_rule=exit_rule,
            readout=self.readout,
            documents=documents,
            any_block=loop_exits,
        )
        if every_loop:
            h = torch.cat(h)
            if documents is not None:  # the exits of loops 1..k, stacked as k x B rows
                documents, rope = documents.repeat(loops), rope.repeat(1, loops, 1, 1)
        h = self.readout(h, rope, cache, exit_films, head, documents)
        if cache is not None:
            cache.advance()
        return h.unflatten(0, (loops, tokens.shape[0])) if every_loop else h

    def positions(
        self, tokens: torch.Tensor, loops: LoopBudget, cache: Cache | None, documents: Documents | None = None
    ) -> torch.Tensor:
        """The RoPE table at the tokens' positions: [2, T, rope_dim // 2] from 0 (or from this rank's
        slice under context parallelism), or [2, B, T, rope_dim // 2] continuing each cached row or,
        with packed `documents`, restarting at each document's start."""
        if cache is not None:
            if self.context_parallel is not None:
                raise ValueError("inference caches do not run under context parallelism; generate without a CP group")
            return self.rope[:, cache.begin(tokens.shape[1], loops)]
        T, start = tokens.shape[1], 0
        if self.context_parallel is not None:
            start, T = self.context_parallel.positions(T)
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len={self.args.max_seq_len}")
        if documents is not None:
            return self.rope[:, documents.positions]
        return self.rope[:, start : start + tokens.shape[1]]

    def documents(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None, cache: Cache | None
    ) -> Documents | None:
        """What the layers read of the documents packed into each row (elr/models/documents.py), once per
        forward; None without `document_ids`. Under context parallelism every shard's ids are gathered
        first: a shard's first document may have started in an earlier shard."""
        if document_ids is None:
            return None
        if cache is not None:
            raise ValueError(
                "document_ids mask documents packed into whole rows; a forward through an inference cache "
                "continues one sequence per row: decode without them"
            )
        check_document_ids(document_ids, tokens)
        start, ids = 0, document_ids
        if self.context_parallel is not None:
            start, _ = self.context_parallel.positions(tokens.shape[1])
            ids = self.context_parallel.gather_document_ids(document_ids)
        with_mask = any("document_mask" in LAYER_KINDS[layer.kind].inputs for layer in self.layers())
        return document_layout(ids, start, tokens.shape[1], with_mask)

    def readout(
        self,
        h: torch.Tensor,
        rope: torch.Tensor,
        cache: Cache | None = None,
        exit_films: list | None = None,
        head: bool = True,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """The output block, norm and head on a recurrent state (with the exit FiLM of its budget, where
        the model has exit heads): logits, or with head=False the normed hidden state. Exit rules that
        compare loops read every loop's state through it (RecurrentBlock.elastic_forward)."""
        for layer, film in zip(self.output_layers, exit_films or [None] * len(self.output_layers)):
            entry = cache.entry(layer, 1) if cache is not None else None
            h = layer(h, rope, film=film, cache=entry, documents=documents)
        h = self.norm(h)
        return self.output(h) if head else h

    def loops_used(self) -> torch.Tensor | None:
        """[B, T]: the loops each token ran in the last forward with an exit rule (None otherwise)."""
        return self.recurrent.loops_used

    def extend_positions(self, max_seq_len: int) -> None:
        """Enlarge the RoPE table to `max_seq_len` positions (never shrinks it); positions past the
        training length were never trained."""
        a = self.args
        if max_seq_len > a.max_seq_len:
            self.args = a = dataclasses.replace(a, max_seq_len=max_seq_len)
            self.rope = rope_table(a.rope_dim, max_seq_len, a.rope_theta).to(self.rope)

    def parameter_roles(self) -> dict[str, str]:
        """{parameter name, as `named_parameters()` gives it: its role (a key of PARAMETER_ROLES)}.

        The ELR modules and the layer kinds' declared gates first, then each parameter by the module
        that holds it; a parameter no rule covers is an error, so a new module declares its role here.
        """
        roles: dict[int, str] = {}

        def declare(module: nn.Module | None, role: str) -> None:
            for p in module.parameters() if module is not None else ():
                roles.setdefault(id(p), role)

        declare(self.tok_embeddings, "embedding")
        declare(self.output, "head")
        declare(self.recurrent.step_size, "step_size")
        declare(self.recurrent.conditioning, "conditioning")
        declare(self.recurrent.loop_gates, "loop_gate")
        declare(self.recurrent.loop_deltas, "loop_delta")
        for module in self.modules():
            if isinstance(module, MoE):
                declare(module.router, "router")
                roles.setdefault(id(module.w1), "matrix")
                roles.setdefault(id(module.w2), "matrix")
        for layer in self.layers():
            for name in LAYER_KINDS[layer.kind].gates:
                declare(getattr(layer.sublayer, name), "gate")
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                declare(module, "norm")
            elif isinstance(module, ShortConv):
                declare(module, "conv")
            elif isinstance(module, nn.Linear):
                roles.setdefault(id(module.weight), "matrix")
        named = {}
        for name, p in self.named_parameters():
            role = roles.get(id(p), "vector" if p.ndim < 2 else None)
            if role is None:
                raise ValueError(f"parameter {name} has no declared role (ELRModel.parameter_roles)")
            named[name] = role
        return named

    def layers(self) -> Iterator[nn.Module]:
        """Every layer once, in order: the input block, the recurrent block, the output block."""
        return itertools.chain(self.input_layers, self.recurrent.layers, self.output_layers)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_sequence_shards(self, shards) -> None:
        """Install the hook of the ranks each sequence is split over (TP and/or CP; elr/parallel's
        SequenceShards): the MoE balance loss and the per-loop statistics sum over them, so both
        describe whole sequences, as in one process."""
        for moe in self.moe_layers():
            moe.sequence_shards = shards
        self.recurrent.sequence_shards = shards

    @property
    def route_replay(self) -> bool:
        """Whether recurrent MoE layers reuse loop 1's routes on later loops (moe.route_replay); a model
        trained without it may still replay at inference."""
        return self.recurrent.route_replay

    @route_replay.setter
    def route_replay(self, on: bool) -> None:
        self.recurrent.route_replay = on

    @torch.no_grad()
    def set_loop_fade(self, value: float) -> None:
        """The loop gates' scheduled part (identity_loops; elr.loop_fade_steps): 0 keeps every loop past
        the first where its learned gate has it, 1 opens each by one more."""
        if self.recurrent.loop_gates is not None:
            self.recurrent.loop_gates.fade.fill_(value)

    def record_loop_statistics(self, on: bool) -> None:
        """Whether forward records the per-loop statistics `loop_statistics` reports (for the metrics)."""
        self.recurrent.record_statistics = on

    def loop_statistics(self) -> list[dict[str, torch.Tensor]]:
        """Per loop of the last forward that recorded: update norm, step size and FiLM gate means
        (RecurrentBlock.loop_statistics; a collective under TP or CP)."""
        return self.recurrent.loop_statistics()

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Sequence-level balance loss of the last training forward, summed over MoE routing calls
        (every layer, every loop that routed); None without MoE layers or outside training.

        Taking it clears it, so no module keeps a piece of the autograd graph past its step.
        """
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        for moe in self.moe_layers():
            moe.aux_loss = None
        return torch.stack(losses).sum() if losses else None

    def num_flops_per_token(self, seq_len: int, loops: int = 1, every_loop: bool = False) -> int:
        """Training FLOPs per token (forward + backward = 3 x forward), recurrent layers counted k times
        (and, with every_loop, the output block and head too: they run after every loop).

        Weights count 6 FLOPs per multiply-accumulate; each layer kind adds its own terms
        (`LayerKind.flops_per_token`: attention scores, GDP state updates). Left out: the conditioning
        heads (once per sequence) and elementwise work (the state norm). The input adapter
        (state_plus_adapted_input) counts once: W h_in is computed once per forward. Under truncated
        backprop (`backprop_loops`) the loops before the window run forward only (a third), and so
        does the input block when no input is re-injected (no gradient reaches it). The later loops' low-rank
        deltas (`loop_delta_rank` r) add 12 r dim per recurrent layer to each loop past the first.
        """
        a = self.args
        n_in, n_rec, _ = a.partition
        per_layer = [LAYER_KINDS[kind].flops_per_token(a, seq_len) for kind in a.layer_pattern]
        recurrent = sum(per_layer[n_in : n_in + n_rec])
        if self.recurrent.step_size is not None:
            recurrent += 6 * a.dim * a.dim
        exits = loops if every_loop else 1
        once = sum(per_layer[:n_in]) + (6 * a.dim * a.dim if self.recurrent.input_adapter is not None else 0)
        after = sum(per_layer[n_in + n_rec :]) + 6 * a.dim * a.vocab_size
        # every_loop: each exit's loss reaches its own loops, so every loop has a backward
        window = a.recurrence.backprop_loops
        forward_only = loops - window if window and loops > window and not every_loop else 0
        if forward_only and a.recurrence.recurrent_input == "state":
            once //= 3
        deltas = 12 * a.recurrence.loop_delta_rank * a.dim * n_rec * max(loops - 1, 0)
        return once + (loops - forward_only) * recurrent + forward_only * recurrent // 3 + exits * after + deltas
