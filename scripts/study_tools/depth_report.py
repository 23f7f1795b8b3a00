"""The depth suite's report: answer accuracy at each difficulty and loop count k, against untied
models of the same effective depth (docs/study/depth/results.md, docs/study/README.md).

The verdict follows the depth issue's yardstick: h* is the hardest difficulty that the untied model
as deep as k = K solves (>= 90%, mean of seeds) while the matched baseline does not (<= 50%); at h*
an ELR variant should be within 10 points of that control at k = K and 30 points above its own
k = 1 on every seed, its k = 1 within 3 points of the matched baseline at every difficulty, and its
mean accuracy should not fall from k to k + 1. Unconditioned variants are also scored past K.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .runs import Run, carried_note, final_record, latest_checkpoint

UNTIED_K = "untied_k4"  # the control as deep as k = K (variants.toml names it)
MATCHED = "baseline_matched"


def accuracy_of(record: dict, loops: int, difficulties: int) -> list[float]:
    return [record[f"val/acc_k{loops}_d{d}"] for d in range(1, difficulties + 1)]


def extrapolate(folder: Path, factor: int, examples: int) -> dict[int, list[float]]:
    """Accuracy per difficulty at k = 1 .. factor x K of an unconditioned run's final weights."""
    from elr.infer.evaluate import task_accuracy
    from elr.infer.load import load_model
    from elr.text.tasks import build_task

    model, cfg = load_model(latest_checkpoint(folder))
    d = cfg["data"]
    task = build_task(d["task"], d["task_items"], d["task_max_difficulty"])
    K = model.args.recurrence.max_loops
    return {k: task_accuracy(model, task, cfg["training"]["seed"], examples, k) for k in range(1, factor * K + 1)}


def collect(runs: list[Run], variants: dict, difficulties: int, extrapolation_examples: int) -> dict:
    """variant -> label, seeds, per-seed accuracy [k][d], their mean, and (unconditioned ELR) past K."""
    results = {}
    for variant, spec in variants.items():
        finished = [(r, final_record(r.folder, r.steps)) for r in runs if r.variant == variant]
        finished = [(r, rec) for r, rec in finished if rec is not None]
        if not finished:
            continue
        K = sum(1 for key in finished[0][1] if key.startswith("val/loss_k"))
        per_seed = {r.seed: [accuracy_of(rec, k, difficulties) for k in range(1, K + 1)] for r, rec in finished}
        mean = [
            [statistics.fmean(acc[k][d] for acc in per_seed.values()) for d in range(difficulties)] for k in range(K)
        ]
        entry = {
            "label": spec["label"],
            "groups": spec["groups"],
            "seeds": sorted(per_seed),
            "K": K,
            "per_seed": per_seed,
            "accuracy": mean,
        }
        if K > 1 and spec.get("extrapolate") and extrapolation_examples:
            beyond = {r.seed: extrapolate(r.folder, 2, extrapolation_examples) for r, _ in finished}
            entry["beyond"] = {
                k: [statistics.fmean(b[k][d] for b in beyond.values()) for d in range(difficulties)]
                for k in next(iter(beyond.values()))
            }
        results[variant] = entry
    return results


def hardest_separating(results: dict) -> int | None:
    """h*: the hardest difficulty the depth-K control solves (>= 0.9) and the matched baseline does
    not (<= 0.5), both as means over seeds; None if no difficulty separates them."""
    if UNTIED_K not in results or MATCHED not in results:
        return None
    deep, base = results[UNTIED_K]["accuracy"][0], results[MATCHED]["accuracy"][0]
    separating = [d + 1 for d in range(len(deep)) if deep[d] >= 0.9 and base[d] <= 0.5]
    return max(separating) if separating else None


def verdicts(results: dict) -> list[str]:
    """The yardstick's checks for every ELR variant, each line saying what was measured."""
    h = hardest_separating(results)
    if h is None:
        return [
            "No difficulty separates the depth-K control (>= 90%) from the matched baseline (<= 50%): "
            "the task does not measure depth at this budget."
        ]
    deep = results[UNTIED_K]["accuracy"][0][h - 1]
    base_acc = results[MATCHED]["accuracy"][0]
    lines = [f"h* = {h}: the untied depth-K control reaches {deep:.1%}, the matched baseline {base_acc[h - 1]:.1%}."]
    for r in results.values():
        if r["K"] < 2:
            continue
        K = r["K"]
        at_k = [acc[K - 1][h - 1] for acc in r["per_seed"].values()]
        gains = [acc[K - 1][h - 1] - acc[0][h - 1] for acc in r["per_seed"].values()]
        one_gap = max(abs(r["accuracy"][0][d] - base_acc[d]) for d in range(len(base_acc)))
        means = [statistics.fmean(row) for row in r["accuracy"]]
        monotone = all(b >= a for a, b in zip(means, means[1:]))
        checks = [
            (
                all(deep - a <= 0.10 for a in at_k),
                f"k={K} at h*: {', '.join(f'{a:.1%}' for a in at_k)} "
                f"(wanted: within 10 points of {deep:.1%} on every seed)",
            ),
            (
                all(g >= 0.30 for g in gains),
                f"k={K} - k=1 at h*: {', '.join(f'{g:+.1%}' for g in gains)} (wanted: >= +30 points on each seed)",
            ),
            (
                one_gap <= 0.03,
                f"k=1 vs matched baseline: largest gap {one_gap:.1%} over difficulties (wanted: <= 3 points)",
            ),
            (
                monotone,
                f"mean accuracy by k: {' / '.join(f'{m:.1%}' for m in means)} (wanted: never falls from k to k + 1)",
            ),
        ]
        lines.append(f"{r['label']}: " + "; ".join(f"{'met' if ok else 'NOT met'}: {text}" for ok, text in checks))
    return lines


def write_markdown(results: dict, out: Path, steps: int, seeds: list[int], task: str, carried: list[str] = ()) -> None:
    difficulties = len(next(iter(results.values()))["accuracy"][0])
    lines = [
        f"# Depth suite ({task}; seeds {', '.join(map(str, seeds))}; {steps} updates each)",
        "",
        "Answer accuracy on held-out examples at each difficulty d (hops or binding depth) and loop count k, "
        "mean over the finished seeds. Made by `python scripts/study.py --suite depth`.",
        "",
    ]
    lines += carried_note(carried)
    lines += (
        ["## Verdict", ""]
        + [f"- {line}" for line in verdicts(results)]
        + [
            "",
            "## Accuracy",
            "",
            "| variant | seeds | k | " + " | ".join(f"d={d}" for d in range(1, difficulties + 1)) + " | mean |",
            "|" + "---|" * (difficulties + 4),
        ]
    )
    for r in results.values():
        for k, row in enumerate(r["accuracy"], 1):
            lines.append(
                f"| {r['label']} | {len(r['seeds'])} | {k} | "
                + " | ".join(f"{a:.2f}" for a in row)
                + f" | {statistics.fmean(row):.3f} |"
            )
    beyond = {v: r for v, r in results.items() if "beyond" in r}
    if beyond:
        lines += [
            "",
            "## Past the trained depth (unconditioned, not tested by the paper)",
            "",
            "| variant | k | " + " | ".join(f"d={d}" for d in range(1, difficulties + 1)) + " | mean |",
            "|" + "---|" * (difficulties + 3),
        ]
        for r in beyond.values():
            for k, row in r["beyond"].items():
                lines.append(
                    f"| {r['label']} | {k}{' (past K)' if int(k) > r['K'] else ''} | "
                    + " | ".join(f"{a:.2f}" for a in row)
                    + f" | {statistics.fmean(row):.3f} |"
                )
    seeds_section = [
        "",
        "## Per seed at k = K",
        "",
        "| variant | seed | " + " | ".join(f"d={d}" for d in range(1, difficulties + 1)) + " |",
        "|" + "---|" * (difficulties + 2),
    ]
    for r in results.values():
        for seed, acc in r["per_seed"].items():
            seeds_section.append(f"| {r['label']} | {seed} | " + " | ".join(f"{a:.2f}" for a in acc[-1]) + " |")
    (out / "results.md").write_text("\n".join(lines + seeds_section) + "\n")


def plot(results: dict, out: Path) -> Path:
    """Accuracy against difficulty: one panel per ELR variant with a line per k, the baselines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    elr = {v: r for v, r in results.items() if r["K"] > 1}
    controls = {v: r for v, r in results.items() if r["K"] == 1}
    fig, axes = plt.subplots(1, max(1, len(elr)), figsize=(4.2 * max(1, len(elr)), 3.6), squeeze=False)
    for ax, (_, r) in zip(axes[0], elr.items() or [(None, None)]):
        for v, c in controls.items():
            ds = range(1, len(c["accuracy"][0]) + 1)
            ax.plot(
                ds,
                c["accuracy"][0],
                linestyle="--",
                color="gray" if v == MATCHED else "black",
                alpha=0.5 + 0.5 * (v == UNTIED_K),
                label=c["label"],
            )
        if r is not None:
            for k, row in enumerate(r["accuracy"], 1):
                ax.plot(range(1, len(row) + 1), row, marker="o", label=f"k={k}")
            ax.set_title(r["label"], fontsize=8)
        ax.set(xlabel="difficulty (hops)", ylabel="answer accuracy", ylim=(-0.02, 1.02))
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / "accuracy_vs_difficulty.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
