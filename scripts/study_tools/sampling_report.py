"""The text suite's sampling rows: the recommended recipe under each loop-sampling mode, its loss seed
by seed and the time its draws make data-parallel ranks wait (docs/study/README.md).

The wait is the sampler's own expectation (elr.train.loop_sampler.expected_wait): a microbatch costs
what its slowest rank's k costs, the fixed part (embedding, input and output blocks, head) counted in
loops from the run's own FLOPs.
"""

from __future__ import annotations

from .stats import paired, per_seed

# (mode, variant) in the order the section shows them; the comparisons read the first against the others
MODES = {"stratified": "sampling_strat", "independent": "sampling_indep", "synchronized": "sampling_sync"}
# the cluster a production run draws for: koi4b.toml at 8 GPUs (scripts/estimate_cost.py)
CLUSTER = (8, 96)


def wait_figures(model, cfg: dict) -> dict:
    """{layout: [wait factor, distinct depths per update]} of a run's sampling: as the run itself drew
    (its emulated ranks x microbatches) and at CLUSTER."""
    from elr.train.loop_sampler import LoopSampler, expected_wait

    e, t = cfg["elr"], cfg["training"]
    seq_len = t["seq_len"]
    f1 = model.num_flops_per_token(seq_len, 1)
    fixed = f1 / (model.num_flops_per_token(seq_len, 2) - f1) - 1
    sampler = LoopSampler(e["max_loops"], e["sampling"], e["one_loop_override"], e["loop_weights"])
    ranks = e.get("emulated_ranks", 1)
    n_micro = t["global_batch_size"] // t["local_batch_size"] // ranks
    return {
        f"{ranks}x{n_micro}": list(expected_wait(sampler, ranks, n_micro, fixed)),
        f"{CLUSTER[0]}x{CLUSTER[1]}": list(expected_wait(sampler, *CLUSTER, fixed)),
    }


def within_spread(a: dict, b: dict) -> list[bool]:
    """Per k: is a's paired mean difference from b no larger than b's own seed spread (sd over seeds)?"""
    out = []
    for k in range(1, min(len(a["loss"]), len(b["loss"])) + 1):
        p = paired(per_seed(a, k), per_seed(b, k))
        out.append(p is not None and p["n"] > 1 and abs(p["mean"]) <= b["std"][k - 1])
    return out


def sampling_section(results: dict, title: str, claim: str) -> list[str]:
    rows = {mode: results[v] for mode, v in MODES.items() if v in results}
    if not rows:
        return []
    K = max(len(r["loss"]) for r in rows.values())
    layouts = list(next(iter(rows.values())).get("wait", {}))
    lines = [
        f"## {title}",
        "",
        claim,
        "",
        "Validation loss (nats per byte, mean ± sd over seeds) at each k; the wait factor is the sampler's "
        "expected step time over the same work without waiting (each microbatch costs its slowest rank's k), "
        "for the layout the run drew (ranks x microbatches) and for koi4b's 8 GPUs.",
        "",
        "| sampling | seeds | "
        + " | ".join(f"k={k}" for k in range(1, K + 1))
        + " | "
        + " | ".join(f"wait x, {lay}" for lay in layouts)
        + " | depths per update |",
        "|" + "---|" * (K + 3 + len(layouts)),
    ]
    for mode, r in rows.items():
        cells = [f"{m:.4f} ± {s:.4f}" if len(r["seeds"]) > 1 else f"{m:.4f}" for m, s in zip(r["loss"], r["std"])]
        waits = r.get("wait", {})
        lines.append(
            f"| {mode} | {len(r['seeds'])} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{waits[lay][0]:.2f}" for lay in layouts)
            + " | "
            + (" / ".join(f"{waits[lay][1]:.1f}" for lay in layouts) or "–")
            + " |"
        )
    first, *others = rows
    lines += [
        "",
        f"Paired per seed ({first} − other, nats per byte: mean ± sd, seeds lower); 'within spread' when "
        "the mean difference is no larger than the other mode's seed sd at that k.",
        "",
        "| comparison | " + " | ".join(f"k={k}" for k in range(1, K + 1)) + " | within spread at every k |",
        "|" + "---|" * (K + 2),
    ]
    for other in others:
        a, b = rows[first], rows[other]
        cells = []
        for k in range(1, K + 1):
            p = paired(per_seed(a, k), per_seed(b, k))
            cells.append("–" if p is None else f"{p['mean']:+.4f} ± {p['sd']:.4f} ({p['below']}/{p['n']})")
        spread = within_spread(a, b)
        lines.append(f"| {first} − {other} | " + " | ".join(cells) + f" | {'yes' if all(spread) else 'no'} |")
    return lines + [""]
