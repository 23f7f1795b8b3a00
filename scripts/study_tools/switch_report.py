"""The late-switch study's table (issue 57; docs/recurrence.md shows it for prose and code): every run of a
protocol group (study_tools/protocol.py) paired seed by seed with the group's matched baseline, with its own
architecture trained at k = 1 only, and every k with its own k = 1, as the mean and the range over seeds with
the count of seeds below zero, so no verdict reads stronger than the signs allow.
"""

from __future__ import annotations

from .stats import best_k, fmt_range, per_seed, relative, seed_range, sign_word

# The goal the issue sets a switch (issue 57, "Done when"), on each corpus: k = 1 within +0.5% of the matched
# baseline over 3 seeds with no seed above +1%, the best k at least 1% below the run's own k = 1, and k = K
# within 0.3% of the best k (a curve that does not turn up).
PARITY_MEAN, PARITY_WORST, LOOP_GAIN, CURVE_TURN, GOAL_SEEDS = 0.005, 0.01, -0.01, 0.003, 3


def vs(a: dict, ka: int, b: dict | None, kb: int) -> dict | None:
    """a at ka against b at kb, seed by seed, as a relative seed range (None without b or a shared seed)."""
    return None if b is None else seed_range(relative(per_seed(a, ka), per_seed(b, kb)))


def row_figures(results: dict, variant: str, base: dict, flops_base: dict | None) -> dict:
    """One run's paired figures: k = 1 against the matched baseline and against its own k = 1-only control,
    each k >= 2 against its own k = 1, its best k (by mean loss) against the FLOPs-matched baseline and k = K
    against its best k; the goal's parts (`goal`: {part: met}) where it has loops."""
    r = results[variant]
    K = len(r["loss"])
    best = best_k(r) if K > 1 else 1
    fig = {
        "vs_baseline": vs(r, 1, base, 1),
        "vs_k1_control": vs(r, 1, results.get(r.get("k1_control")), 1),
        "curve": {k: vs(r, k, r, 1) for k in range(2, K + 1)},
        "best_k": best,
        "vs_flops": vs(r, best, flops_base, 1) if flops_base is not None and flops_base is not r else None,
        "turn": vs(r, K, r, best) if K > 1 else None,
        "goal": None,
    }
    one, gain, turn = fig["vs_baseline"], fig["curve"].get(best), fig["turn"]
    if K > 1 and one is not None:
        fig["goal"] = {
            "parity": one["mean"] <= PARITY_MEAN and one["max"] <= PARITY_WORST,
            "loops buy 1%": gain["mean"] <= LOOP_GAIN,
            "no turn-up": turn["mean"] <= CURVE_TURN,
        }
    return fig


# How a missed part reads in the table ("not met: loops buy under 1%", not the part's own name).
MISSED = {
    "parity": "k = 1 outside parity",
    "loops buy 1%": "loops buy under 1%",
    "no turn-up": "k = K over 0.3% above the best k",
}


def goal_cell(fig: dict) -> str:
    goal, one = fig["goal"], fig["vs_baseline"]
    if goal is None:
        return "–"
    missed = [MISSED[part] for part, ok in goal.items() if not ok]
    word = "met" if not missed else f"not met: {', '.join(missed)}"
    if one["n"] < GOAL_SEEDS:
        word += f" ({one['n']} seed{'s' * (one['n'] > 1)}: screen only)"
    return word


def flops_note(results: dict, members: list[str]) -> list[str]:
    """How the FLOPs-matched baseline is matched, with its ratio and updates."""
    matched = next((results[v] for v in members if results[v].get("flops_of")), None)
    if matched is None:
        return []
    target = results.get(matched["flops_of"], {})
    base_steps = target.get("steps", "the suite's")
    return [
        f"The FLOPs-matched baseline ({matched['label']}) is the matched baseline trained on the training FLOPs of "
        f"`{matched['flops_of']}`: the same batch, peak lr, warmup and schedule shape, {matched['steps']} updates "
        f"instead of {base_steps} (FLOPs ratio {matched['flops_vs_baseline']:.3f}; per token, "
        "model.num_flops_per_token at each update's expected loop counts, scripts/study_tools/protocol.py).",
        "",
    ]


def switch_section(results: dict, members: list[str], title: str, claim: str) -> list[str]:
    """The table of one protocol group and one line of signs per run with loops; empty without the group's
    matched baseline among the results."""
    base_name = next((results[v]["baseline"] for v in members if results[v].get("baseline")), None)
    base = results.get(base_name)
    if base is None:
        return []
    flops_base = next((results[v] for v in members if results[v].get("flops_of")), None)
    K = max(len(results[v]["loss"]) for v in members)
    curve_heads = [f"k = {k} vs own k = 1" for k in range(2, K + 1)]
    header = [
        "run",
        "seeds",
        "updates",
        "FLOPs vs baseline",
        "k = 1 vs matched baseline",
        "k = 1 vs own k = 1-only",
        *curve_heads,
        "best k vs FLOPs-matched baseline",
        "goal",
    ]
    lines = [
        f"## {title}",
        "",
        f"{claim} Each cell is the per-seed relative difference (run − reference) / reference as `mean "
        "(min..max) n/N below`: its mean and range over the seeds both runs have, and how many of them lie below "
        "zero. References: the matched baseline on the same schedule and seed; the run's own architecture "
        "trained at k = 1 only (`k1_control`: its [elr] options at max_loops 1, same schedule and seed); its own "
        f"k = 1. The goal needs {GOAL_SEEDS} seeds; fewer is a screen.",
        "",
    ]
    lines += flops_note(results, members)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for v in members:
        r = results[v]
        fig = row_figures(results, v, base, flops_base)
        curve = [fmt_range(fig["curve"].get(k)) if k <= len(r["loss"]) else "–" for k in range(2, K + 1)]
        flops = r.get("flops_vs_baseline")
        best = f"k = {fig['best_k']}: {fmt_range(fig['vs_flops'])}" if fig["vs_flops"] else "–"
        cells = [
            r["label"],
            str(len(r["seeds"])),
            str(r.get("steps", "–")),
            "–" if flops is None else f"{flops:.2f}x",
            "–" if r is base else fmt_range(fig["vs_baseline"]),
            fmt_range(fig["vs_k1_control"]),
            *curve,
            best,
            goal_cell(fig),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if len(r["loss"]) > 1:
            b, K_r = fig["best_k"], len(r["loss"])
            parts = [f"k = 1 vs matched baseline: {sign_word(fig['vs_baseline'])}"]
            if fig["vs_k1_control"]:
                parts.append(f"vs own k = 1-only: {sign_word(fig['vs_k1_control'])}")
            parts.append(f"best k (k = {b}) vs own k = 1: {sign_word(fig['curve'][b])}")
            if b != K_r:
                parts.append(f"k = {K_r} vs k = {b}: {sign_word(fig['turn'])}")
            notes.append(f"- {r['label']}: " + "; ".join(parts) + ".")
    lines += ["", "Signs, seed by seed (what the seeds allow saying, no more):", "", *notes]
    return lines + [""]
