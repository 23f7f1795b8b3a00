"""Elastic depth: the recurrent block's loop with rows or tokens that stop early.

Three uses share it, none of them the plain training forward (RecurrentBlock.forward):
- a budget per row (`loops` a LongTensor [B], mixed budgets in one batch): the forward runs the largest;
  a row whose budget is spent passes the later loops unchanged (its state kept, the cache told not to
  store its results), so it gets exactly what it gets alone, FiLM and exit FiLM of its own budget included;
- a cache (inference): each layer gets its cache entry for loop i (keys and values, or a state);
- an exit rule (adaptive depth, elr/models/early_exit.py; `loops` is then the cap): each token stops after
  the loop the rule lets it go and passes the later loops unchanged in the same way; `readout(s, films)`
  gives the logits of a state, for rules that compare them. The loops each token ran are left in
  `block.loops_used` [B, T]. Through a cache it runs one token at a time.
Every loop is `block.step`, the training loop's own body.
"""

from __future__ import annotations

import torch


def elastic_forward(
    block,
    h_in: torch.Tensor,
    rope: torch.Tensor,
    loops,
    cache=None,
    every_loop: bool = False,
    exit_rule=None,
    readout=None,
):
    """RecurrentBlock.forward's result for per-row budgets, a cache or an exit rule."""
    budgets = loops if torch.is_tensor(loops) else None
    least, most = (int(budgets.min()), int(budgets.max())) if budgets is not None else (loops, loops)
    block.check_loops(least, most, every_loop, per_row=budgets is not None)
    exited = logp = block.loops_used = None
    if exit_rule is not None:
        if budgets is not None or every_loop or (cache is not None and h_in.shape[1] != 1):
            raise ValueError(
                "an exit rule takes one loop count (its cap), and decodes one token at a time "
                "through a cache (prefill at a fixed k)"
            )
        exited = torch.zeros(h_in.shape[:2], dtype=torch.bool, device=h_in.device)
        block.loops_used = torch.full_like(exited, most, dtype=torch.long)
    block._recorded = []
    routes = block.new_routes()
    s, states = block.initial_state(h_in, most), []
    injected = block.input_adapter(h_in) if block.input_adapter is not None else None
    for i in range(1, most + 1):
        running = budgets >= i if budgets is not None and i > least else None  # rows still looping (None: all)
        if exited is not None and i > 1:
            running = ~exited  # tokens still looping
        if cache is not None:
            cache.set_rows(running if running is None or running.ndim == 1 else running[:, 0], loop=i)
        kept = s  # a row or token that has stopped keeps its state as it left its last loop
        s = block.step(s, i, loops, most, h_in, injected, rope, routes, cache=cache, running=running)
        if exited is not None and i < most:
            logp_next = readout(s, block.exit_films(i)).float().log_softmax(-1) if exit_rule.needs_logits else None
            stop = exit_rule.exits(kept, s, logp, logp_next) & ~exited
            block.loops_used.masked_fill_(stop, i)
            exited, logp = exited | stop, logp_next
        states.append(s)
        if exited is not None and bool(exited.all()):
            break
    if cache is not None:
        cache.set_rows(None)
    budget = block.loops_used if exited is not None else loops
    exit_films = block.exit_films(budget, h_in.shape[0] if every_loop else 0)
    return (states if every_loop else s), exit_films
