"""Figures from evaluate.py's JSON (score against loop count k and against relative latency), or
from a run's metrics.jsonl (training loss per k and per-loop update norms over steps).

    python scripts/plot_loops.py outputs/debug/eval.json --out-dir docs/figures
    python scripts/plot_loops.py outputs/debug/metrics.jsonl     # -> outputs/debug/metrics_over_steps.png

From metrics.jsonl: `<name>_over_steps.png`, three panels: the training loss of each k (points: the
steps where some slot ran that k), the validation loss of each k, and each loop's update norm
||s_i - s_{i-1}|| / ||s_{i-1}|| (the logging window's means, loop1/update_norm ...) on a log axis.

Writes `<name>_vs_k.png` (one panel per metric, the baseline as a dashed line; like the paper's
Figure 2) and `<name>_vs_latency.png` (each metric against decode time relative to k=1; like its
Figure 7). With adaptive-depth results (`evaluate.py --exit ...`) also `<name>_vs_mean_loops.png`: each
metric the rules scored against the mean loops their tokens ran, beside the fixed-k curve (k loops a
token). Needs matplotlib (`pip install -e ".[plot]"`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from elr.cli import HelpFormatter


def score_metrics(rows: dict) -> list[str]:
    return [m for m in rows if not m.startswith("latency/")]


def plot(result: dict, out_dir: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, loops = result["rows"], result["loops"]
    baseline = (result.get("baseline") or {}).get("rows") or {}
    metrics = score_metrics(rows)
    if not metrics:
        raise ValueError("the results hold no score rows to plot")
    cols = min(3, len(metrics))
    shape = (math.ceil(len(metrics) / cols), cols)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def grid():
        return plt.subplots(*shape, figsize=(4 * cols, 3 * shape[0]), squeeze=False)

    def save(fig, axes, path: Path) -> None:
        for ax in list(axes.flat)[len(metrics) :]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    fig, axes = grid()
    for ax, metric in zip(axes.flat, metrics):
        ax.plot(loops, [rows[metric][str(k)] for k in loops], marker="o", label="ELR")
        if metric in baseline:
            ax.axhline(baseline[metric]["1"], linestyle="--", color="gray", label="baseline")
        ax.set(title=metric, xlabel="loops k", xticks=loops)
        ax.legend()
    save(fig, axes, out_dir / f"{name}_vs_k.png")

    latency = rows.get("latency/decode_s_per_token_rel")
    if latency:
        fig, axes = grid()
        for ax, metric in zip(axes.flat, metrics):
            xs, ys = [latency[str(k)] for k in loops], [rows[metric][str(k)] for k in loops]
            ax.plot(xs, ys, marker="o", label="ELR")
            for k, x, y in zip(loops, xs, ys):
                ax.annotate(f"k={k}", (x, y), textcoords="offset points", xytext=(4, 4))
            if metric in baseline and "latency/decode_s_per_token_rel" in baseline:
                ax.plot(
                    [baseline["latency/decode_s_per_token_rel"]["1"]],
                    [baseline[metric]["1"]],
                    marker="s",
                    linestyle="none",
                    color="gray",
                    label="baseline",
                )
            ax.set(title=metric, xlabel="decode time per token, relative to k=1")
            ax.legend()
        save(fig, axes, out_dir / f"{name}_vs_latency.png")

    adaptive = result.get("adaptive") or {}
    scored = [m for m in metrics if any(m in values for values in adaptive.values())]
    if scored:
        metrics[:] = scored  # `save` blanks the panels past them
        fig, axes = grid()
        for ax, metric in zip(axes.flat, scored):
            ax.plot(loops, [rows[metric][str(k)] for k in loops], marker="o", label="fixed k")
            points = [(v[f"{metric}/mean_loops"], v[metric], rule) for rule, v in adaptive.items() if metric in v]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="^", linestyle="none", label="exit rule")
            for x, y, rule in points:
                ax.annotate(rule, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            ax.set(title=metric, xlabel="mean loops per token")
            ax.legend()
        save(fig, axes, out_dir / f"{name}_vs_mean_loops.png")
    return written


def plot_metrics(path: Path, out_dir: Path, name: str) -> list[Path]:
    """Loss per k, validation loss per k and per-loop update norms against the step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not any("loss/train" in r for r in records):
        raise ValueError(f"{path} holds no training records")
    fig = metrics_figure(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}_over_steps.png"
    fig.tight_layout()
    fig.savefig(target, dpi=80)
    plt.close(fig)
    return [target]


def metrics_figure(records: list[dict]):
    """The panels of plot_metrics. Update norms on a log axis: loop 1's is ~100 and a later loop's
    ~0.006 at the quick start, which a linear axis draws as zero."""
    import matplotlib.pyplot as plt

    def series(pattern: str) -> dict[str, tuple[list[int], list[float]]]:
        found: dict[str, tuple[list[int], list[float]]] = {}
        for r in records:
            for key, value in r.items():
                if re.fullmatch(pattern, key):
                    steps, values = found.setdefault(key, ([], []))
                    steps.append(r["step"])
                    values.append(value)
        return dict(sorted(found.items(), key=lambda kv: int(re.search(r"\d+", kv[0]).group())))

    panels = [
        ("training loss per k", series(r"loss/k\d+"), "linear"),
        ("validation loss per k", series(r"val/loss_k\d+"), "linear"),
        ("update norm per loop", series(r"loop\d+/update_norm"), "log"),
    ]
    panels = [panel for panel in panels if panel[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2), squeeze=False)
    for ax, (title, lines, scale) in zip(axes.flat, panels):
        for key, (steps, values) in lines.items():
            ax.plot(
                steps,
                values,
                marker="." if len(steps) < 50 else None,
                label=key.split("/")[-1] if "loop" not in key else key.split("/")[0],
            )
        ax.set(title=title, xlabel="step", yscale=scale)
        ax.legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("results", type=Path, help="JSON written by scripts/evaluate.py --out, or a run's metrics.jsonl")
    p.add_argument("--out-dir", type=Path, help="folder for the PNGs (default: beside the JSON)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('plot_loops: error: needs matplotlib (pip install -e ".[plot]")', file=sys.stderr)
        return 2
    try:
        out_dir = args.out_dir or args.results.parent
        if args.results.suffix == ".jsonl":
            written = plot_metrics(args.results, out_dir, args.results.stem)
        else:
            written = plot(json.loads(args.results.read_text()), out_dir, args.results.stem)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_loops: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
