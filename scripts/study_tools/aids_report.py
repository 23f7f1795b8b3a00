"""The text suite's training-aid rows: each aid on the recommended recipe, set beside what untied depth
buys (docs/study/README.md, "Text: untied depth against loops"). A loop gain is worth reading against that yardstick:
the untied 2/8/2 stack's loss below the matched baseline is what looping the recurrent block could buy.
"""

from __future__ import annotations

from .stats import best_k, fmt_paired, paired, per_seed, relative

RECIPE = "cond_exit_only"  # the recommended recipe the aids are added to
YARDSTICK = "untied_k2"  # the recurrent layers written out twice: the depth of k = 2, untied
BASELINE = "baseline_matched"


def aids_section(results: dict, members: list[str], title: str, claim: str) -> list[str]:
    """Per aid, paired by seed: k = 1 and the best k against the matched baseline, the best k against the
    run's own k = 1 (the loop gain), and the best k against the recipe's best k; the untied yardstick's
    row first. Empty without the matched baseline."""
    base = results.get(BASELINE)
    if base is None:
        return []
    b1 = per_seed(base, 1)
    lines = [
        f"## {title}",
        "",
        f"{claim} Paired relative differences by seed (mean ± sd, seeds below zero); "
        f"the untied 2/8/2 row is what depth buys at this budget.",
        "",
        "| run | seeds | k = 1 vs matched baseline | best k | best k vs matched baseline "
        "| loop gain: best k vs own k = 1 | best k vs the recipe's best k |",
        "|---|---|---|---|---|---|---|",
    ]
    if YARDSTICK in results:
        r = results[YARDSTICK]
        depth = paired(relative(per_seed(r, 1), b1), dict.fromkeys(r["seeds"], 0.0))
        lines.append(f"| {r['label']} | {len(r['seeds'])} | – | – | {fmt_paired(depth)} | – | – |")
    recipe = results.get(RECIPE)
    for v in ([RECIPE] if recipe else []) + [m for m in members if m != RECIPE]:
        r = results[v]
        if len(r["loss"]) < 2:
            continue
        k = best_k(r)
        zero = dict.fromkeys(r["seeds"], 0.0)
        one = paired(relative(per_seed(r, 1), b1), zero)
        best = paired(relative(per_seed(r, k), b1), zero)
        gain = paired(relative(per_seed(r, k), per_seed(r, 1)), zero)
        vs_recipe = (
            paired(relative(per_seed(r, k), per_seed(recipe, best_k(recipe))), zero) if recipe and v != RECIPE else None
        )
        cells = [fmt_paired(one), str(k), fmt_paired(best), fmt_paired(gain), fmt_paired(vs_recipe)]
        lines.append(f"| {r['label']} | {len(r['seeds'])} | " + " | ".join(cells) + " |")
    return lines + [""]
