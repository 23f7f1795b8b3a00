"""Elastic Latent Recurrence: the recurrent block and its k-loop (docs/DESIGN.md §3.3).

    s_0 = h_in                         (initial_state_noise: + sigma ε in training, k >= 2)
    for i in 1..k:
        s_{i-1} <- norm(s_{i-1})       (state_norm, i >= 2; backprop_loops n: detached at i = k - n + 1)
        s~_i = s_{i-1}                 (state_plus_input: s_{i-1} + h_in from loop 2 on;
                                        state_plus_adapted_input: s_{i-1} + W h_in on every loop, W = 0 at init)
        r_i  = R(s~_i ; c_{i,k})       c_{i,k} = E_loop[i] + E_budget[k] drives per-layer FiLM heads
        s_i  = update(s_{i-1}, s~_i, r_i)   (identity_loops: s_{i-1} + γ_i (s_i - s_{i-1}) for i >= 2, γ = 0 at init)

(loop_delta_rank r: in loops i >= 2 each recurrent sublayer L_l adds B_{i,l} A_{i,l} h, h its normed input,
B = 0 at init.)

r_i is the recurrent block's full output: its layers are pre-norm residual, so r_i = s~_i + (what
the layers add). The update rules (the paper's Figure 4a compares a learned step with parameter-free
residual addition or replacement; the formulas are our reading, docs/LOG.md):

    replace         s_i = r_i                             k=1 is the plain stack
    residual        s_i = s_{i-1} + r_i                   k=1 is NOT: s_1 = h_in + r_1
    adaptive_delta  s_i = s_{i-1} + a_i (r_i - s_{i-1})   k=1 is the plain stack at init (a_i = 1)

Re-injection starts at loop 2 because s_0 is already h_in: adding it at loop 1 too would feed the
block 2 h_in. So k=1 is the plain stack with either input (Table 14 has them nearly equal at k=1).

The training aids of the looped-model literature (issue 35) are options too, each an identity at
init or outside k = 1: the adapter W starts at zero, the state norm and the noise act only between or
before loops 2..k, and truncated backprop changes gradients, not the forward. `depth_scaled_init`
changes only the initial weights (elr/models/model.py). `identity_loops` makes every loop past the first an
identity at init (zero gates, conditioning offsets from index 1 that start at zero), so a model grown from a
one-loop phase at a late switch computes at every k what it computed at k = 1; `loop_gate = "scaled"` makes
each gate the fade times the learned part, so the optimizer cannot shut what the fade opens, and
`loop_delta_rank` gives loops 2..K low-rank deltas of their own on the shared sublayers (zero at init).

The training forward (`RecurrentBlock.forward`) runs the loop above and nothing else. Elastic depth,
the inference concerns (a budget per row, a cache, an exit rule: `RecurrentBlock.elastic_forward`),
wraps the same loop body, `step`, from outside, holding in place the rows or tokens that stop early.
What every loop of a forward reads besides the state (h_in, W h_in, RoPE, MoE routes, the budget, the
cache, the packed documents) is one `LoopContext`, built once per forward.

The block and its loop are one module, so FSDP can make it one unit that is called exactly once
per microbatch whatever k is (a unit called a different number of times on different ranks
desynchronises the collectives). At initialisation every ELR-specific path is an identity: the
adaptive step is exactly 1 and the FiLM heads are exactly zero, so k=1 equals the plain stack
(except under `residual`, which is another network at every k).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from elr.config.recurrence import RecurrenceOptions
from elr.models.args import ModelArgs
from elr.models.budget import LoopBudget, budget_range
from elr.models.cache import Cache
from elr.models.documents import Documents
from elr.models.early_exit import ExitRule
from elr.models.ffn import Route

# The option strings of `update`, `recurrent_input` and `step_input` are the `Literal`s of their fields,
# elr/config/recurrence.py. What the learned step sees (our choice; the paper gives no equation for
# it): the block's input s~ ("state"), the change the block proposes r - s ("delta"), or nothing, a
# per-channel step shared by every token ("channel").


class AdaptiveStep(nn.Module):
    """Step size a = 2 sigmoid(z) in (0, 2), a = 1 exactly at init (z = 0).

    z = W norm(x) + b per token and channel, x chosen by `step_input`; or z = b, one step per
    channel. W and b start at zero, so the initial model is the plain stack bit for bit.
    """

    def __init__(self, dim: int, eps: float, step_input: str = "state"):
        super().__init__()
        self.step_input = step_input
        if step_input == "channel":
            self.bias = nn.Parameter(torch.empty(dim))
        else:
            self.norm = nn.RMSNorm(dim, eps=eps)
            self.proj = nn.Linear(dim, dim)

    def init_weights(self):
        if self.step_input == "channel":
            nn.init.zeros_(self.bias)
            return
        self.norm.reset_parameters()
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, s: torch.Tensor, s_in: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if self.step_input == "channel":
            return 2 * torch.sigmoid(self.bias)
        x = s_in if self.step_input == "state" else r - s
        return 2 * torch.sigmoid(self.proj(self.norm(x)))


class LoopGates(nn.Module):
    """γ_i for loops i = 2..K, one per channel, zero at init: loop i moves the state by γ_i times what its
    update rule proposes, so a loop past the first starts as the identity and opens as training finds it
    useful (the growth of Net2Net and ReZero: the grown network computes what the smaller one did).

    `fade` is a scalar the trainer raises from 0 to 1 after a late switch (elr.loop_fade_steps) and that stays
    in the checkpoint, so a model read at any step computes what it trained; 0 without a fade. `added`:
    γ_i = weight_i + fade (weight_i = 0 at init), which the learned part can cancel; `scaled`: γ_i = fade ·
    max(1 + weight_i, floor), a loop opened by the fade that the learned part scales but cannot shut below
    floor × fade (the clamp passes no gradient below the floor)."""

    def __init__(self, max_loops: int, dim: int, form: str = "added", floor: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_loops - 1, dim))
        self.register_buffer("fade", torch.zeros(()))
        self.scaled, self.floor = form == "scaled", floor

    def init_weights(self):
        nn.init.zeros_(self.weight)
        self.fade.zero_()

    def gate(self, i: int) -> torch.Tensor:
        if self.scaled:
            return self.fade * torch.clamp(1 + self.weight[i - 2], min=self.floor)
        return self.weight[i - 2] + self.fade

    def forward(self, s: torch.Tensor, s_next: torch.Tensor, i: int) -> torch.Tensor:
        return torch.lerp(s, s_next, self.gate(i).to(s_next.dtype))


@dataclass(frozen=True)
class FiLMTable:
    """The loop conditioning's output for every loop i and budget k of one set of weights
    (LoopConditioning.table): `loops[i - 1]`, per recurrent layer, its FiLM tensors [K, dim] (row k - 1 for
    budget k; None where loop i is unconditioned); `exits`, per output-block layer, the exit FiLM [K, dim]."""

    loops: list[list[tuple[torch.Tensor, ...]] | None]
    exits: list[tuple[torch.Tensor, ...]]


class LoopDeltas(nn.Module):
    """Per loop i = 2..K and recurrent sublayer l, a rank-r map B_{i,l} A_{i,l} whose output the sublayer adds to
    its own (`loop_delta_rank`; elr/models/layers.py, Layer): the later loops' own parameters beside the shared
    ones. B starts at zero, so every loop computes what the shared block does until training moves it; A starts
    at std dim^-1/2, so B's first gradients are of the size of the sublayer's input. One module called once per
    (loop, sublayer), so tensor parallelism can run it on each rank's tokens (LocalCompute)."""

    def __init__(self, max_loops: int, n_layers: int, dim: int, rank: int):
        super().__init__()
        self.down = nn.Parameter(torch.empty(max_loops - 1, n_layers, rank, dim))
        self.up = nn.Parameter(torch.empty(max_loops - 1, n_layers, dim, rank))

    def init_weights(self):
        nn.init.normal_(self.down, std=self.down.shape[-1] ** -0.5)
        nn.init.zeros_(self.up)

    def forward(self, h: torch.Tensor, loop: int, layer: int) -> torch.Tensor:
        """B_{loop,layer} A_{loop,layer} h for loop >= 2."""
        return F.linear(F.linear(h, self.down[loop - 2, layer]), self.up[loop - 2, layer])


class LoopConditioning(nn.Module):
    """c_{i,k} = E_loop[i] + E_budget[k], mapped per recurrent layer to FiLM (scale, shift, gate).

    The heads start at exactly zero (weights and bias) so adding them changes nothing yet still
    receives gradients; the embeddings start small (std 0.02) so the heads' first updates are too.
    Options (the `conditioning_*` fields of RecurrenceOptions, each a remedy measured against the
    later loops being switched off, docs/LOG.md, 2026-12-01): `conditioning_budget` false drops
    E_budget, so the first i loops of any budget are the same computation (a budget-k run holds every
    shorter one); `conditioning_gate` false drops the gate term, the sublayer's output then is never
    scaled per loop; `conditioning_first_loop` false leaves loop 1 unconditioned, so k=1 is exactly the
    shared block; `conditioning_later_loops` false leaves loops 2..k unconditioned, so the heads cannot
    scale them down (what the conditioned runs learn to do); `conditioning_silu` passes c through a
    SiLU before the heads (as DiT's adaLN does), so a head is no longer additive in i and k and can
    single out a pair such as "the last loop of k". `conditioning_exit` gives the output block's
    `exit_layers` layers heads of their own, fed E_budget[k] alone: the output block can read the
    state of each budget in its own way, and with both loop options false that is the only
    conditioning, so no loop can be scaled down. `identity_loops`: the embedding of index j >= 2 is row 1's
    plus a zero-initialised row of its own, so every loop and budget starts with budget 1's conditioning.
    """

    def __init__(self, n_layers: int, dim: int, cond_dim: int, options: RecurrenceOptions, exit_layers: int):
        super().__init__()
        o = options
        self.budget, self.gate, self.silu = o.conditioning_budget, o.conditioning_gate, o.conditioning_silu
        self.first_loop, self.later_loops = o.conditioning_first_loop, o.conditioning_later_loops
        self.offsets = o.identity_loops
        self.n_layers = n_layers
        loops_conditioned = self.first_loop or self.later_loops
        exit_layers = exit_layers if o.conditioning_exit else 0
        width = (3 if self.gate else 2) * dim
        self.loop_embed = nn.Embedding(o.max_loops, cond_dim) if loops_conditioned else None
        self.budget_embed = (
            nn.Embedding(o.max_loops, cond_dim) if (self.budget and loops_conditioned) or exit_layers else None
        )
        self.heads = nn.ModuleList(nn.Linear(cond_dim, width) for _ in range(n_layers if loops_conditioned else 0))
        self.exit_heads = nn.ModuleList(nn.Linear(cond_dim, width) for _ in range(exit_layers))

    def init_weights(self):
        for embed in (self.loop_embed, self.budget_embed):
            if embed is not None:
                nn.init.normal_(embed.weight, std=0.02)
                if self.offsets:
                    nn.init.zeros_(embed.weight[1:])
        for head in [*self.heads, *self.exit_heads]:
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def forward(
        self, loop: int | None, loops, rows: int = 0, table: FiLMTable | None = None
    ) -> list[tuple[torch.Tensor, ...] | None]:
        """Per recurrent layer (scale, shift, gate), (scale, shift) without the gate, or None, for
        loop `loop` of a `loops`-loop forward; loop None: per output-block layer (`exit`). `loops` may
        be a LongTensor of budgets, [B] (one per row) or [B, T] (one per token): each gets its own.
        `table` (inference: `table()` of these weights): the same FiLM read from it, no head run."""
        if table is not None and not rows:
            films = table.exits if loop is None else table.loops[loop - 1]
            if films is None:
                return [None] * self.n_layers
            index = (loops - 1)[:, None] if torch.is_tensor(loops) and loops.ndim == 1 else loops - 1
            return [tuple(t[index] for t in film) for film in films]
        if loop is None:
            return self._exit_films(loops, rows)
        if not (self.first_loop if loop == 1 else self.later_loops):
            return [None] * self.n_layers
        c = self._row(self.loop_embed, loop)
        if self.budget and torch.is_tensor(loops):
            return self._per_budget(self.heads, lambda budgets: c + self._row(self.budget_embed, budgets), loops)
        if self.budget:
            c = c + self._row(self.budget_embed, loops)
        return self._films(self.heads, c, per_row=True)

    @torch.no_grad()
    def table(self) -> FiLMTable:
        """The FiLM of every (loop, budget) pair these weights give: c_{i,k} depends on nothing else, so
        inference computes it once per set of weights and reads rows of it (elr/infer/static_cache.py)."""
        embed = self.loop_embed if self.loop_embed is not None else self.budget_embed
        budgets = torch.arange(1, embed.num_embeddings + 1, device=embed.weight.device)
        loops = []
        for i in range(1, embed.num_embeddings + 1):
            if not (self.first_loop if i == 1 else self.later_loops):
                loops.append(None)
                continue
            c = self._row(self.loop_embed, i)
            c = c + self._row(self.budget_embed, budgets) if self.budget else c.expand(len(budgets), -1)
            loops.append(self._films(self.heads, c))  # each [K, dim]: row k - 1 is budget k's
        exits = self._films(self.exit_heads, self._row(self.budget_embed, budgets)) if self.exit_heads else []
        return FiLMTable(loops, exits)

    def exit(self, loops: int, rows: int = 0) -> list[tuple[torch.Tensor, ...]]:
        """Per output-block layer, FiLM for the state after `loops` loops (needs exit heads). With
        `rows` (every_loop: the exits of loops 1..k stacked, `rows` sequences each) each exit's rows
        get the FiLM of their own budget: tensors of shape [loops * rows, 1, dim]. It runs as a call
        of this module, inside the recurrent block's forward, because that is where parallel wrappers
        make the parameters usable (FSDP unshards the block, TP's LocalCompute hooks forward)."""
        return self(None, loops, rows)

    def _exit_films(self, loops: int, rows: int) -> list[tuple[torch.Tensor, ...]]:
        if not rows and torch.is_tensor(loops):
            return self._per_budget(self.exit_heads, lambda budgets: self._row(self.budget_embed, budgets), loops)
        if not rows:
            return self._films(self.exit_heads, self._row(self.budget_embed, loops), per_row=True)
        budgets = torch.arange(1, loops + 1, device=self.budget_embed.weight.device)
        per_exit = self._films(self.exit_heads, self._row(self.budget_embed, budgets))  # each [loops, dim]
        return [tuple(t.repeat_interleave(rows, 0)[:, None] for t in film) for film in per_exit]

    def _row(self, embed: nn.Embedding, index) -> torch.Tensor:
        """E[index] (an int or a LongTensor of 1-based indices); with offsets, E[1] + the offset row for index >= 2."""
        row = embed.weight[index - 1]
        if not self.offsets:
            return row
        if not torch.is_tensor(index):
            return row if index == 1 else row + embed.weight[0]
        return row + (index > 1).unsqueeze(-1).to(row.dtype) * embed.weight[0]

    def _per_budget(self, heads: nn.ModuleList, c_of, loops: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """FiLM for budgets per row [B] or per token [B, T]: the heads run once on each budget the embeddings
        cover (`c_of(budgets)`, [K, cond_dim]), not once per row, and each row or token takes its budget's
        ([B, 1, dim] or [B, T, dim]): a batch's conditioning costs what one budget's does."""
        budgets = torch.arange(1, self.budget_embed.num_embeddings + 1, device=loops.device)
        films = self._films(heads, c_of(budgets))  # each [K, dim]
        index = loops - 1 if loops.ndim > 1 else (loops - 1)[:, None]
        return [tuple(t[index] for t in film) for film in films]

    def _films(self, heads: nn.ModuleList, c: torch.Tensor, per_row: bool = False) -> list[tuple[torch.Tensor, ...]]:
        """c: [..., cond_dim]; `per_row` (c is [B, cond_dim], one budget per row): FiLM [B, 1, dim]."""
        if self.silu:
            c = F.silu(c)
        films = [tuple(head(c).chunk(3 if self.gate else 2, dim=-1)) for head in heads]
        return [tuple(t[:, None] for t in film) for film in films] if per_row and c.ndim == 2 else films


@dataclass(frozen=True)
class LoopContext:
    """What every loop of one forward reads besides the state, built once per forward
    (RecurrentBlock.loop_context) and handed to each `step`."""

    h_in: torch.Tensor  # the input block's output: s_0 (before any noise) and the re-injected input
    injected: torch.Tensor | None  # W h_in (state_plus_adapted_input), computed once
    rope: torch.Tensor
    routes: list[Route | None]  # per layer: the MoE routes loop 1 records and later loops replay (route_replay)
    loops: LoopBudget  # k, or one k per row: what the conditioning reads
    most: int  # the loops this forward runs (the largest budget)
    cache: Cache | None = None  # inference: each layer's entry at loop i
    documents: Documents | None = None  # documents packed into each row (elr/models/documents.py), or None


# The output block, norm and head on a state: readout(s, rope, cache, exit_films, documents=...) -> logits
# (ELRModel.readout). Exit rules that compare loops' next-token distributions read every loop through it.
Readout = Callable[[torch.Tensor, torch.Tensor, Cache | None, list | None], torch.Tensor]


class RecurrentBlock(nn.Module):
    """The recurrent layers and their k-loop. With max_loops = 1, update = replace and no
    conditioning (ModelArgs' defaults) it is the middle of the non-recurrent baseline."""

    def __init__(self, args: ModelArgs, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        o = args.recurrence  # checked as ModelArgs were built (RecurrenceOptions.check_buildable)
        self.max_loops, self.update, self.recurrent_input = o.max_loops, o.update, o.recurrent_input
        self.step_size = AdaptiveStep(args.dim, args.norm_eps, o.step_input) if o.update == "adaptive_delta" else None
        self.conditioning = (
            LoopConditioning(len(layers), args.dim, args.cond_dim, o, exit_layers=args.partition[2])
            if o.conditioning
            else None
        )
        self.backprop_loops, self.initial_state_noise = o.backprop_loops, o.initial_state_noise
        self.input_adapter = (
            nn.Linear(args.dim, args.dim, bias=False) if o.recurrent_input == "state_plus_adapted_input" else None
        )
        self.state_norm = nn.RMSNorm(args.dim, eps=args.norm_eps) if o.state_norm else None
        self.loop_gates = (
            LoopGates(o.max_loops, args.dim, o.loop_gate, o.loop_gate_floor)
            if o.identity_loops and o.max_loops > 1
            else None
        )
        self.loop_deltas = (
            LoopDeltas(o.max_loops, len(layers), args.dim, o.loop_delta_rank)
            if o.loop_delta_rank and o.max_loops > 1
            else None
        )
        self.route_replay = args.moe_route_replay
        # While `record_statistics` is on, forward records what `loop_statistics` reports (the metrics).
        self.record_statistics = False
        self._recorded: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        self.loops_used: torch.Tensor | None = None  # [B, T]: loops each token ran, after an exit-rule forward
        # The ranks each sequence is split over (TP / CP): a hook set by elr/parallel/parallelize.py,
        # over which `loop_statistics` sums, so the statistics describe whole sequences.
        self.sequence_shards = None

    def init_weights(self):
        """The ELR parameters' init (the layers are initialised by the model, which knows their depth):
        every one an identity, so k = 1 is the plain stack."""
        if self.step_size is not None:
            self.step_size.init_weights()
        if self.conditioning is not None:
            self.conditioning.init_weights()
        if self.input_adapter is not None:
            nn.init.zeros_(self.input_adapter.weight)
        if self.state_norm is not None:
            self.state_norm.reset_parameters()
        if self.loop_gates is not None:
            self.loop_gates.init_weights()
        if self.loop_deltas is not None:
            self.loop_deltas.init_weights()

    @property
    def prefix_consistent(self) -> bool:
        """Whether the first i loops are the same computation at every budget k >= i, so one forward
        at k yields the states of every shorter budget (no budget embedding)."""
        c = self.conditioning
        return c is None or not c.budget or not (c.first_loop or c.later_loops)

    def forward(
        self,
        h_in: torch.Tensor,
        rope: torch.Tensor,
        loops: LoopBudget,
        cache: Cache | None = None,
        every_loop: bool = False,
        exit_rule: ExitRule | None = None,
        readout: Readout | None = None,
        documents: Documents | None = None,
        any_block: bool = False,
    ) -> tuple[torch.Tensor | list[torch.Tensor], list | None]:
        """s_0 = h_in; s_i = update(s_{i-1}, L(cond(s~_{i-1}, i, k))) for i = 1..k. Returns (s_k, the
        output block's FiLM for budget k or None without exit heads); with `every_loop`, ([s_1, ..., s_k],
        each exit's FiLM) (needs a prefix-consistent block, unless `any_block`: then s_i is loop i of this
        k-loop forward, whatever budget i alone would compute). `documents`: the documents packed into each
        row, which every loop's token mixers keep apart.

        A budget per row (`loops` a LongTensor [B]), a cache, or an exit rule is elastic depth
        (`elastic_forward`): the same loop body, with rows that stop early held in place."""
        if torch.is_tensor(loops) or cache is not None or exit_rule is not None:
            return self.elastic_forward(h_in, rope, loops, cache, every_loop, exit_rule, readout, documents)
        self.check_loops(loops, loops, every_loop and not any_block, per_row=False)
        self._recorded, self.loops_used = [], None
        ctx = self.loop_context(h_in, rope, loops, loops, documents=documents)
        s, states = self.initial_state(h_in, loops), []
        for i in range(1, loops + 1):
            s = self.step(s, i, ctx)
            states.append(s)
        return (states if every_loop else s), self.exit_films(loops, h_in.shape[0] if every_loop else 0)

    def elastic_forward(
        self,
        h_in: torch.Tensor,
        rope: torch.Tensor,
        loops: LoopBudget,
        cache: Cache | None = None,
        every_loop: bool = False,
        exit_rule: ExitRule | None = None,
        readout: Readout | None = None,
        documents: Documents | None = None,
    ) -> tuple[torch.Tensor | list[torch.Tensor], list | None]:
        """Elastic depth: the loop with rows or tokens that stop early, `forward`'s result for three uses
        (never the plain training forward), each wrapping the same `step`:
        - a budget per row (`loops` a LongTensor [B], mixed budgets in one batch): the forward runs the
          largest; a row whose budget is spent passes the later loops unchanged (its state kept, the cache
          told not to store its results), so it gets exactly what it gets alone, FiLM and exit FiLM of its
          own budget included;
        - a cache (inference): each layer gets its cache entry for loop i (keys and values, or a state);
        - an exit rule (adaptive depth, elr/models/early_exit.py; `loops` is then the cap): each token stops
          after the loop the rule lets it go and passes the later loops unchanged in the same way; rules
          that compare logits read each loop's state through `readout` (the model's output block and
          head, ELRModel.readout). The loops each token ran are left in `loops_used` [B, T]. Through a
          cache it runs one token at a time."""
        least, most = cache.loop_range(loops) if cache is not None else budget_range(loops)
        per_row = torch.is_tensor(loops)
        self.check_loops(least, most, every_loop, per_row=per_row)
        exited = logp = self.loops_used = None
        if exit_rule is not None:
            if per_row or every_loop or (cache is not None and h_in.shape[1] != 1):
                raise ValueError(
                    "an exit rule takes one loop count (its cap), and decodes one token at a time "
                    "through a cache (prefill at a fixed k)"
                )
            exited = torch.zeros(h_in.shape[:2], dtype=torch.bool, device=h_in.device)
            self.loops_used = torch.full_like(exited, most, dtype=torch.long)
        self._recorded = []
        ctx = self.loop_context(h_in, rope, loops, most, cache, documents)
        s, states = self.initial_state(h_in, most), []
        for i in range(1, most + 1):
            running = loops >= i if per_row and i > least else None  # rows still looping (None: all)
            if exited is not None and i > 1:
                running = ~exited  # tokens still looping
            if cache is not None:
                cache.set_rows(running if running is None or running.ndim == 1 else running[:, 0], loop=i)
            kept = s  # a row or token that has stopped keeps its state as it left its last loop
            s = self.step(s, i, ctx, running)
            if exited is not None and i < most:
                logp_next = None
                if exit_rule.needs_logits:
                    logits = readout(s, rope, cache, self.exit_films(i, cache=cache), documents=documents)
                    logp_next = logits.float().log_softmax(-1)
                stop = exit_rule.exits(kept, s, logp, logp_next) & ~exited
                self.loops_used.masked_fill_(stop, i)
                exited, logp = exited | stop, logp_next
            states.append(s)
            if exited is not None and not torch.compiler.is_compiling() and bool(exited.all()):
                break  # eager only: a compiled step runs its loops (exited tokens pass them unchanged)
        if cache is not None:
            cache.set_rows(None)
        budget = self.loops_used if exited is not None else loops
        return (states if every_loop else s), self.exit_films(budget, h_in.shape[0] if every_loop else 0, cache)

    def loop_context(
        self,
        h_in: torch.Tensor,
        rope: torch.Tensor,
        loops: LoopBudget,
        most: int,
        cache: Cache | None = None,
        documents: Documents | None = None,
    ) -> LoopContext:
        """What every loop of a forward that runs `most` loops at budget `loops` reads besides the state."""
        injected = self.input_adapter(h_in) if self.input_adapter is not None else None
        return LoopContext(h_in, injected, rope, self.new_routes(), loops, most, cache, documents)

    def step(self, s: torch.Tensor, i: int, ctx: LoopContext, running: torch.Tensor | None = None) -> torch.Tensor:
        """Loop i: s~ = the loop's input from s, r = the layers on s~ conditioned on (i, k), s_i = the
        update of s by r with the learned step. `running` (elastic depth): the rows or tokens still
        looping; the others keep their state."""
        kept = s
        s = self._between_loops(s, i, ctx.most)
        s_in = self._loop_input(s, ctx, i)
        table = ctx.cache.films if ctx.cache is not None else None  # inference: precomputed FiLM, if the cache has it
        films = (
            self.conditioning(i, ctx.loops, table=table) if self.conditioning is not None else [None] * len(self.layers)
        )
        r = s_in
        for j, (layer, film, route) in enumerate(zip(self.layers, films, ctx.routes)):
            entry = ctx.cache.entry(layer, i) if ctx.cache is not None else None
            delta = partial(self.loop_deltas, loop=i, layer=j) if self.loop_deltas is not None and i > 1 else None
            r = layer(r, ctx.rope, film=film, route=route, cache=entry, documents=ctx.documents, delta=delta)
        a = self.step_size(s, s_in, r) if self.step_size is not None else None  # the learned step a_i
        s_next = self._update(s, r, a)
        if self.loop_gates is not None and i > 1:
            s_next = self.loop_gates(kept, s_next, i)
        if running is not None:
            s_next = torch.where(running.view(*running.shape, *[1] * (s.ndim - running.ndim)), s_next, kept)
        if self.record_statistics:
            self._recorded.append(self._record(s, s_next, a, films, i))
        return s_next

    def check_loops(self, least: int, most: int, every_loop: bool, per_row: bool) -> None:
        if least < 1 or (most > self.max_loops and self.conditioning is not None):
            raise ValueError(
                f"loops={most if least >= 1 else least} is outside 1..{self.max_loops}, the loop counts "
                "this model's conditioning embeddings cover (an unconditioned model runs any k >= 1; "
                "beyond its max_loops it extrapolates)"
            )
        if every_loop and (not self.prefix_consistent or per_row):
            raise ValueError(
                "every_loop needs one loop count and loop conditioning without the budget embedding "
                "(conditioning_budget = False)"
            )

    def new_routes(self) -> list:
        """One MoE route store per layer that replays loop 1's routes on later loops (route_replay)."""
        return [Route() if self.route_replay and "route" in layer.inputs else None for layer in self.layers]

    def exit_films(self, loops, rows: int = 0, cache: Cache | None = None) -> list | None:
        """The output block's FiLM for the state after `loops` loops (an int, or per row or token), or
        None without exit heads (read from the cache's precomputed table where it has one)."""
        c = self.conditioning
        if c is None or not c.exit_heads:
            return None
        table = cache.films if cache is not None else None
        return c(None, loops, rows, table) if table is not None else c.exit(loops, rows)

    def initial_state(self, h_in: torch.Tensor, loops: int) -> torch.Tensor:
        """s_0: h_in, plus sigma ε in a training forward of k >= 2 loops (initial_state_noise). The noise
        is seeded from the CPU generator, which checkpoints save, so a resumed run draws the same noise
        on any device; the seed is drawn at every k, so all ranks' generators advance alike."""
        if not (self.training and self.initial_state_noise > 0):
            return h_in
        seed = int(torch.randint(2**62, (), dtype=torch.int64))
        if loops == 1:
            return h_in
        gen = torch.Generator(device=h_in.device).manual_seed(seed)
        noise = torch.randn(h_in.shape, generator=gen, device=h_in.device, dtype=h_in.dtype)
        return h_in + self.initial_state_noise * noise

    def _between_loops(self, s: torch.Tensor, i: int, loops: int) -> torch.Tensor:
        """The state entering loop i: detached where truncated backprop starts (backprop_loops), then
        normed from loop 2 on (state_norm), so the norm's own weight keeps its gradient."""
        if i == 1:
            return s
        if self.backprop_loops and i == loops - self.backprop_loops + 1:
            s = s.detach()
        return self.state_norm(s) if self.state_norm is not None else s

    def _loop_input(self, s: torch.Tensor, ctx: LoopContext, i: int) -> torch.Tensor:
        """s~_i, what loop i's layers read: the state, plus h_in from loop 2 on (state_plus_input) or
        plus W h_in on every loop (state_plus_adapted_input; `ctx.injected` = W h_in, computed once)."""
        if ctx.injected is not None:
            return s + ctx.injected
        if self.recurrent_input == "state_plus_input" and i > 1:
            return s + ctx.h_in
        return s

    def _update(self, s, r, a):
        if self.update == "adaptive_delta":
            # lerp(s, r, 1) is exactly r, so the initial model is the plain stack bit for bit.
            return torch.lerp(s, r, a.to(r.dtype))
        if self.update == "residual":
            return s + r
        return r

    @torch.no_grad()
    def _record(self, s, s_next, a, films, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One loop as this rank sees it: the squared norms of the update and of the state summed
        over its tokens, and its mean step size; and the values the same on every rank: the mean FiLM
        gate and the mean loop gate (identity_loops), where the block has them."""
        parts = torch.stack(
            [
                (s_next - s).float().square().sum(),
                s.float().square().sum(),
                a.float().mean() if a is not None else s.new_zeros((), dtype=torch.float32),
            ]
        )
        shared = {}
        if self.conditioning is not None and self.conditioning.gate and films[0] is not None:
            shared["film_gate_mean"] = torch.stack([1 + film[2].float().mean() for film in films]).mean()
        if self.loop_gates is not None and i > 1:
            shared["loop_gate_mean"] = self.loop_gates.gate(i).float().mean()
        return parts, shared

    def loop_statistics(self) -> list[dict[str, torch.Tensor]]:
        """Per loop of the last recorded forward: update_norm ||s_i - s_{i-1}|| / ||s_{i-1}|| (s_{i-1} after
        the state norm, where there is one), and step_size_mean, film_gate_mean and loop_gate_mean where
        the block has them. With `sequence_shards` the parts
        are summed over the ranks that split each sequence (a collective on each of them; their
        slices are of equal size), so they describe whole sequences, as in one process."""
        if not self._recorded:
            return []
        parts = torch.stack([p for p, _ in self._recorded])  # [loops, 3]
        if self.sequence_shards is not None:
            parts = self.sequence_shards.sum(parts)
            parts[:, 2] /= self.sequence_shards.size
        statistics = []
        for (update_sq, state_sq, step_size_mean), (_, shared) in zip(parts, self._recorded):
            stats = {"update_norm": update_sq.sqrt() / state_sq.sqrt().clamp(min=1e-12)}
            if self.step_size is not None:
                stats["step_size_mean"] = step_size_mean
            statistics.append({**stats, **shared})
        return statistics
