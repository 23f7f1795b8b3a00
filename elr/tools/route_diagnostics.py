"""How far MoE routes drift between loops, measured on a trained checkpoint (the paper's route-replay
diagnostics, arXiv 2610.12582: tokens keep 53% of their loop-1 experts at loop 4, selection counts
have cosine 0.978, routed-output cosine 0.767 with loop-1 routes vs 0.227 for shifted routes).

    python scripts/route_diagnostics.py outputs/study/text/runs/moe_dynamic/seed0/checkpoint/step-600

The model runs at k = K with dynamic routing on validation batches; every recurrent MoE layer's input
is kept at each loop i. Per loop i >= 2, averaged over those layers:
  kept            fraction of a token's loop-1 experts it picks again at loop i
  count cosine    cosine of the per-expert selection counts, loop 1 vs loop i
  routed cosine   per-token cosine between the routed output at loop i under loop-1 routes (replay) and
                  under its own routes; the control uses the loop-1 routes of the previous token
  full cosine     the same for the whole MoE output (routed + shared expert)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from elr.data.validation import val_batches
from elr.infer.load import load_model
from elr.models.ffn import MoE

METRICS = ("kept", "count_cosine", "routed_cosine", "routed_cosine_shifted", "full_cosine", "full_cosine_shifted")


def shifted(route: dict, batch: int) -> dict:
    """Each token gets the routes of the token before it (the first token of a row keeps its own)."""

    def shift(t):
        t = t.view(batch, -1, t.shape[-1])
        return torch.cat([t[:, :1], t[:, :-1]], dim=1).flatten(0, 1)

    return {"indices": shift(route["indices"]), "weights": shift(route["weights"])}


def compare(moe: MoE, x1: torch.Tensor, xi: torch.Tensor) -> dict[str, float]:
    """Loop-1 input x1 and loop-i input xi of one MoE layer: the metrics above."""
    B, _, dim = xi.shape
    first = dict(zip(("indices", "weights"), moe.choose_experts(x1.reshape(-1, dim), B)))
    own = dict(zip(("indices", "weights"), moe.choose_experts(xi.reshape(-1, dim), B)))
    shared = moe.shared(xi).reshape(-1, dim) if moe.shared is not None else 0

    def outputs(route):
        full = moe(xi, route=route).reshape(-1, dim)
        return full - shared, full

    routed_own, full_own = outputs(own)
    routed_replay, full_replay = outputs(first)
    routed_shift, full_shift = outputs(shifted(first, B))
    E = moe.w1.shape[0]
    counts = [torch.bincount(r["indices"].flatten(), minlength=E).float() for r in (first, own)]
    kept = (own["indices"][:, :, None] == first["indices"][:, None, :]).any(-1).float().mean()

    def cos(a, b):
        return F.cosine_similarity(a, b, dim=-1).mean().item()

    return {
        "kept": kept.item(),
        "count_cosine": F.cosine_similarity(*counts, dim=0).item(),
        "routed_cosine": cos(routed_replay, routed_own),
        "routed_cosine_shifted": cos(routed_shift, routed_own),
        "full_cosine": cos(full_replay, full_own),
        "full_cosine_shifted": cos(full_shift, full_own),
    }


@torch.no_grad()
def route_drift(model, batches) -> dict[int, dict[str, float]]:
    """Loop i -> metric -> mean over recurrent MoE layers and batches, dynamic routing at k = K."""
    moes = [layer.sublayer for layer in model.recurrent.layers if isinstance(layer.sublayer, MoE)]
    if not moes:
        raise ValueError("the model has no MoE layer in its recurrent block")
    K = model.args.recurrence.max_loops
    if K < 2:
        raise ValueError("the model runs one loop only: there is no later loop to compare")
    replay, model.route_replay = model.route_replay, False
    inputs: dict[MoE, list[torch.Tensor]] = {m: [] for m in moes}
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs[mod].append(args[0])) for m in moes]
    sums = {i: dict.fromkeys(METRICS, 0.0) for i in range(2, K + 1)}
    n = 0
    try:
        for tokens, *_ in batches:
            for xs in inputs.values():
                xs.clear()
            model(tokens, loops=K)
            for moe, xs in inputs.items():
                for i in range(2, K + 1):
                    for name, value in compare(moe, xs[0], xs[i - 1]).items():
                        sums[i][name] += value
            n += len(moes)
    finally:
        for hook in hooks:
            hook.remove()
        model.route_replay = replay
    return {i: {name: value / n for name, value in metrics.items()} for i, metrics in sums.items()}


def drift_for_checkpoint(checkpoint: Path, data: Path | None, batches: int) -> dict[int, dict[str, float]]:
    model, cfg = load_model(checkpoint)
    t = cfg["training"]
    path = Path(data or cfg["data"]["path"]) / "val.bin"
    return route_drift(model, val_batches(str(path), t["seq_len"], t["local_batch_size"], batches, 0, 1))
