"""The text suite's report: validation loss at every k against the paper's tables, and the per-loop
statistics that show whether the later loops work (docs/study/text/results.md, docs/study/README.md)."""

from __future__ import annotations

import statistics
from pathlib import Path

from .aids_report import aids_section
from .paper import CLAIMS, GROUPS, PAPER, PAPER_BASELINE, READING_WORDS, READINGS, paper_difference, paper_rows
from .protocol import PROTOCOL_KEYS
from .runs import Run, carried_note, final_validation, latest_checkpoint
from .sampling_report import sampling_section, wait_figures
from .stats import best_k, fmt_paired, paired, per_seed, relative, summarise, verdict
from .switch_report import switch_section


def val_windows(data: Path, cfg: dict, batches: int):
    """The first validation batches of the run's shape: the same windows its own validation read."""
    from elr.data.validation import val_batches

    t = cfg["training"]
    return val_batches(str(data / "val.bin"), t["seq_len"], t["local_batch_size"], batches, 0, 1)


def loop_statistics(model, batches) -> dict[str, list[float]]:
    """Per-loop update norm ||s_i - s_{i-1}|| / ||s_{i-1}||, step size and FiLM gate means at k = K,
    measured on validation batches with the run's final weights: a model that switched its later
    loops off shows norms near zero there."""
    import torch

    batches = list(batches)
    loops = model.args.recurrence.max_loops
    model.record_loop_statistics(True)
    sums: dict[str, list[float | None]] = {}  # None: the loop has no such statistic (an unconditioned loop's gate)
    with torch.no_grad():
        for inputs, *_ in batches:
            model(inputs, loops=loops)
            for i, stats in enumerate(model.loop_statistics()):
                for name, value in stats.items():
                    row = sums.setdefault(name, [None] * loops)
                    row[i] = (row[i] or 0.0) + value.item() / len(batches)
    model.record_loop_statistics(False)
    return sums


def replay_at_inference_loss(model, batches) -> float:
    """Validation loss at k = K of a dynamically trained MoE run with route replay switched on,
    on the batches its own final validation used."""
    import torch

    from elr.train.loss import summed_loss

    model.route_replay = True
    total = count = 0.0
    with torch.no_grad():
        for inputs, labels, *_ in batches:
            total += summed_loss(model(inputs, loops=model.args.recurrence.max_loops), labels).item()
            count += labels.numel()
    model.route_replay = False
    return total / count


def mean_per_key(dicts: list[dict]) -> dict:
    """Element-wise mean of equally shaped {key: list or {metric: value}} results over seeds."""
    first = dicts[0]
    if isinstance(first, dict):
        return {key: mean_per_key([d[key] for d in dicts]) for key in first}
    if isinstance(first, list):  # None: a statistic the loop does not have (the same on every seed)
        return [None if first[i] is None else statistics.fmean(d[i] for d in dicts) for i in range(len(first))]
    return statistics.fmean(dicts)


def collect(runs: list[Run], variants: dict, data: Path, stats_batches: int, val_steps: int | None) -> dict:
    from elr.tools.route_diagnostics import route_drift

    results = {}
    for variant, spec in variants.items():
        # every finished seed counts: a grid cut short reports each variant over the seeds it has
        finished = [(r, final_validation(r.folder, r.steps)) for r in runs if r.variant == variant]
        finished = [(r, run_losses) for r, run_losses in finished if run_losses is not None]
        if not finished:
            continue
        mine, losses = [r for r, _ in finished], [run_losses for _, run_losses in finished]
        K = len(losses[0])
        per_k = [summarise([run_losses[k] for run_losses in losses]) for k in range(K)]
        entry = {
            "label": spec["label"],
            "groups": spec["groups"],
            "seeds": [r.seed for r in mine],
            "loss": [m for m, _ in per_k],
            "std": [s for _, s in per_k],
            "per_seed": losses,
            "steps": mine[0].steps,
        }
        entry.update({key: spec[key] for key in PROTOCOL_KEYS if key in spec})
        replay_check = "table_1" in spec["groups"] and not spec["overrides"].get("moe.route_replay")
        if K > 1:  # one load of each run's final weights for every measurement below
            from elr.infer.load import load_model

            measured = []
            for r in mine:
                model, cfg = load_model(latest_checkpoint(r.folder))
                m = {"loop_stats": loop_statistics(model, val_windows(data, cfg, stats_batches))}
                if "sampling" in spec["groups"]:
                    m["wait"] = wait_figures(model, cfg)
                if replay_check:
                    m["route_drift"] = route_drift(model, val_windows(data, cfg, stats_batches))
                    m["loss_replay_at_inference"] = replay_at_inference_loss(
                        model, val_windows(data, cfg, val_steps or cfg["validation"]["steps"])
                    )
                measured.append(m)
            entry.update(mean_per_key(measured))
        results[variant] = entry
    return results


def fmt(mean: float, std: float, seeds: int) -> str:
    return f"{mean:.4f} ± {std:.4f}" if seeds > 1 else f"{mean:.4f}"


def rank_of(values: dict[str, float]) -> dict[str, int]:
    return {name: i + 1 for i, name in enumerate(sorted(values, key=values.get))}


SWITCH_GROUPS = ("switch_wsd", "switch_cosine")  # protocol groups (study_tools/protocol.py, switch_report.py)


def write_markdown(
    results: dict, out: Path, steps: int, seeds: list[int], carried: list[str] = (), corpus: str = "prose"
) -> None:
    K = max(len(r["loss"]) for r in results.values())
    base = results.get("baseline_matched") or results.get("baseline")
    lines = [
        f"# ELR study results ({corpus}; seeds {', '.join(map(str, seeds))}; {steps} updates each unless a row "
        "says otherwise)",
        "",
        "Validation loss (nats per byte) at each loop count k: mean ± standard deviation over the finished "
        "seeds. Δ compares k = 1 and the best k with the matched baseline's mean. Paper: arXiv 2610.12582, "
        "GPT-0.5B, K = 5 "
        f"(its baseline {PAPER_BASELINE}); its k = 1..{K} are shown. Made by `python scripts/study.py`.",
        "",
    ]
    lines += carried_note(carried)
    for group, (title, claim) in GROUPS.items():
        members = [v for v, r in results.items() if group in r["groups"]]
        if not members:
            continue
        if group == "table_1":
            lines += replay_section(results, members, title, claim)
            continue
        if group == "sampling":
            lines += sampling_section(results, title, claim)
            continue
        if group == "aids":
            lines += aids_section(results, members, title, claim)
            continue
        if group in SWITCH_GROUPS:
            lines += switch_section(results, members, title, claim)
            continue
        if group in ("controls", "remedies"):
            extra = [v for v in ("default",) if v in results and v not in members] if group == "remedies" else []
            section = controls_section if group == "controls" else remedies_section
            lines += section(results, extra + members, title, claim)
            continue
        paper = paper_rows(PAPER.get(group, {}), members)
        lines += [f"## {title}", "", f"Paper: {claim}", ""]
        header = (
            "| variant | seeds | "
            + " | ".join(f"k={k}" for k in range(1, K + 1))
            + " | Δ k=1 / best k vs matched baseline |"
        )
        if paper:
            header += " paper k=1..K | paper rank k=1 / k=K | our rank k=1 / k=K |"
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        ours_1 = {v: results[v]["loss"][0] for v in members if v in paper}
        ours_k = {v: results[v]["loss"][-1] for v in members if v in paper}
        paper_1 = {v: paper[v][0] for v in ours_1}
        paper_k = {v: paper[v][len(results[v]["loss"]) - 1] for v in ours_k}
        for v in members:
            r = results[v]
            cells = [fmt(m, s, len(r["seeds"])) for m, s in zip(r["loss"], r["std"])] + ["–"] * (K - len(r["loss"]))
            delta = (
                f"{100 * (r['loss'][0] / base['loss'][0] - 1):+.2f}% / "
                f"{100 * (min(r['loss']) / base['loss'][0] - 1):+.2f}%"
                if base
                else "–"
            )
            row = f"| {r['label']} | {len(r['seeds'])} | " + " | ".join(cells) + f" | {delta} |"
            if paper:
                if v in paper:
                    row += (
                        f" {' / '.join(f'{x:.4f}' for x in paper[v][: len(r['loss'])])} |"
                        f" {rank_of(paper_1)[v]} / {rank_of(paper_k)[v]} |"
                        f" {rank_of(ours_1)[v]} / {rank_of(ours_k)[v]} |"
                    )
                else:
                    row += " – | – | – |"
            lines.append(row)
        lines.append("")
    lines += claims_section(results) + readings_section(results)
    elr = {v: r for v, r in results.items() if "loop_stats" in r}
    if elr:
        lines += [
            "## Later loops at work",
            "",
            "Relative update norm ||s_i − s_{i−1}|| / ||s_{i−1}|| per loop i at k = K (loop 1 starts from "
            "the "
            "embeddings, so its norm is large); FiLM gate mean 1 + g (1 = unconditioned).",
            "",
            "| variant | " + " | ".join(f"norm loop {i}" for i in range(2, K + 1)) + " | gate mean, loops 1..K |",
            "|" + "---|" * (K + 1),
        ]
        for r in elr.values():
            norms = " | ".join(f"{x:.3f}" for x in r["loop_stats"]["update_norm"][1:])
            gates = r["loop_stats"].get("film_gate_mean")
            gate_means = " / ".join("–" if g is None else f"{g:.2f}" for g in gates) if gates else "–"
            lines.append(f"| {r['label']} | {norms} | {gate_means} |")
        lines.append("")
    (out / "results.md").write_text("\n".join(lines))


def claim_verdict(words: list[str]) -> str:
    """A claim made at several k is reproduced (or contradicted) only when it is at every one of them."""
    return words[0] if len(set(words)) == 1 else "inconclusive"


def paired_by_k(a: dict, b: dict, at: str, sign: int) -> tuple[list[str], list[str]]:
    """a - b seed by seed at every k (or at K only): one cell per k (mean ± sd, seeds with `sign`) and
    the rule's word for each."""
    K = min(len(a["loss"]), len(b["loss"]))
    cells, words = [], []
    for k in range(1, K + 1) if at == "every" else [K]:
        p = paired(per_seed(a, k), per_seed(b, k))
        if p is None:
            break
        words.append(verdict(p["diffs"], sign))
        agree = sum((d > 0) - (d < 0) == sign for d in p["diffs"])
        cells.append(f"k={k}: {p['mean']:+.4f} ± {p['sd']:.4f} ({agree}/{p['n']})")
    return cells, words


def claims_section(results: dict) -> list[str]:
    """Each comparison the paper makes, seed by seed: the paired difference (variant - reference, nats
    per byte) at each k it is claimed at, how many seeds have the paper's sign, and the rule's word."""
    rows = []
    for variant, reference, sign, at, claim in CLAIMS:
        a, b = results.get(variant), results.get(reference)
        if a is None or b is None:
            continue
        cells, words = paired_by_k(a, b, at, sign)
        if words:
            rows.append(
                f"| {claim} | {'lower' if sign < 0 else 'higher'} | {paper_difference(variant, reference)} | "
                f"{'; '.join(cells)} | {claim_verdict(words)} |"
            )
    if not rows:
        return []
    return [
        "## The paper's comparisons, seed by seed",
        "",
        "Variants that share a seed share initialisation, data order and loop draws, so each comparison is "
        "the per-seed difference (variant − reference, nats per byte): mean ± sd, and how many seeds have the "
        "paper's sign. Rule (scripts/study_tools/stats.py): *reproduced* when every seed has the paper's sign (or, "
        "with more than three seeds, a paired t above 2 that way), *contradicted* when every seed has the "
        "opposite sign, otherwise *inconclusive*; a claim made at every k needs the same word at each k.",
        "",
        "| claim | paper: variant is | paper's difference k=1 / k=K | ours, paired per k (seeds with the paper's "
        "sign) | verdict |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def readings_section(results: dict) -> list[str]:
    """The readings the paper leaves open, each option against its alternative seed by seed at every k."""
    rows = []
    for variant, reference, reading in READINGS:
        a, b = results.get(variant), results.get(reference)
        if a is None or b is None:
            continue
        cells, words = paired_by_k(a, b, "every", -1)
        if words:
            shared = len(set(a["seeds"]) & set(b["seeds"]))
            result = READING_WORDS[claim_verdict(words)] if shared > 1 else "one seed: no verdict"
            rows.append(f"| {reading} | `{variant}` − `{reference}` | {'; '.join(cells)} | {result} |")
    if not rows:
        return []
    return [
        "## Readings the paper leaves open, seed by seed",
        "",
        "Each option against its alternative on shared seeds (nats per byte; in brackets the seeds where the "
        "option is lower), worded by the same rule with 'lower' as the claim.",
        "",
        "| reading | option − alternative | paired per k (seeds lower) | result |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def controls_section(results: dict, members: list[str], title: str, claim: str) -> list[str]:
    """Untied depth against the matched baseline, seed by seed: does depth help at this budget?"""
    base = results.get("baseline_matched")
    lines = [
        f"## {title}",
        "",
        f"{claim} Paired relative difference to the matched baseline (mean ± sd over "
        "seeds); 'helps' needs the mean below zero by more than three paired sd.",
        "",
        "| variant | seeds | loss | vs matched baseline | helps |",
        "|---|---|---|---|---|",
    ]
    for v in members:
        r = results[v]
        p = paired(relative(per_seed(r, 1), per_seed(base, 1)), {s: 0.0 for s in r["seeds"]}) if base else None
        helps = "–" if p is None or p["n"] < 2 else ("yes" if p["mean"] < 0 and -p["mean"] > 3 * p["sd"] else "no")
        lines.append(
            f"| {r['label']} | {len(r['seeds'])} | {fmt(r['loss'][0], r['std'][0], len(r['seeds']))} | "
            f"{fmt_paired(p)} | {helps} |"
        )
    return lines + [""]


def remedies_section(results: dict, members: list[str], title: str, claim: str) -> list[str]:
    """Both properties at once, seed by seed: k = 1 against the matched baseline, and the best k
    against the run's own k = 1, with the later loops' update norms."""
    base = results.get("baseline_matched")
    lines = [
        f"## {title}",
        "",
        f"Wanted: {claim.split('wanted: ')[-1]} Paired relative differences (mean ± sd "
        "over seeds). Targets: k = 1 no worse than the matched baseline by more than its seed spread; best k "
        "at least 1% below the run's own k = 1 and by more than three paired sd; every later loop's update "
        "norm above 0.05.",
        "",
        "| variant | seeds | k = 1 vs matched baseline | best k | best k vs own k = 1 | later-loop update norms "
        "| targets |",
        "|---|---|---|---|---|---|---|",
    ]
    spread = base["std"][0] / base["loss"][0] if base else None
    for v in members:
        r = results[v]
        K = len(r["loss"])
        if K < 2:
            continue
        one = paired(relative(per_seed(r, 1), per_seed(base, 1)), {s: 0.0 for s in r["seeds"]}) if base else None
        best = best_k(r)
        gain = paired(relative(per_seed(r, best), per_seed(r, 1)), {s: 0.0 for s in r["seeds"]})
        norms = r.get("loop_stats", {}).get("update_norm", [])[1:]
        met = [
            one is not None and one["mean"] <= spread,
            gain["mean"] <= -0.01 and -gain["mean"] > 3 * gain["sd"],
            bool(norms) and min(norms) > 0.05,
        ]
        missed = [name for name, ok in zip(("parity", "loop gain", "norms"), met) if not ok]
        lines.append(
            f"| {r['label']} | {len(r['seeds'])} | {fmt_paired(one)} | {best} | {fmt_paired(gain)} | "
            f"{' / '.join(f'{n:.3f}' for n in norms) or '–'} | "
            f"{', '.join(missed) + ' not met' if missed else 'all met'} |"
        )
    if spread is not None:
        lines += ["", f"Matched baseline's seed spread at k = 1: {100 * spread:.2f}% (sd / mean)."]
    return lines + [""]


def tradeoff_points(results: dict) -> dict[str, tuple[dict, dict]]:
    """Per remedy (and the paper's recipe): the paired relative k = 1 gap to the matched baseline and
    the paired relative gain of its best k over its own k = 1 (stats.paired: mean, sd over seeds),
    the two properties the recipe wants."""
    base = results.get("baseline_matched")
    points = {}
    for v, r in results.items():
        if base is None or len(r["loss"]) < 2 or not ({"remedies"} & set(r["groups"]) or v == "default"):
            continue
        one = paired(relative(per_seed(r, 1), per_seed(base, 1)), {s: 0.0 for s in r["seeds"]})
        best = best_k(r)
        gain = paired(relative(per_seed(r, best), per_seed(r, 1)), {s: 0.0 for s in r["seeds"]})
        if one is not None:
            points[v] = (one, gain)
    return points


def replay_section(results: dict, members: list[str], title: str, claim: str) -> list[str]:
    lines = [
        f"## {title}",
        "",
        f"Paper: {claim}",
        "",
        "| routing | val loss k=K | Δ vs dynamic | paper Δ |",
        "|---|---|---|---|",
    ]
    dynamic = next((results[v] for v in members if "loss_replay_at_inference" in results[v]), None)
    trained = [results[v] for v in members if results[v] is not dynamic]
    if dynamic:
        d = dynamic["loss"][-1]
        lines += [
            f"| dynamic | {d:.4f} | – | – |",
            f"| replay at inference only | {dynamic['loss_replay_at_inference']:.4f} | "
            f"{dynamic['loss_replay_at_inference'] - d:+.4f} | +0.0055 |",
        ]
        lines += [f"| replay in training | {r['loss'][-1]:.4f} | {r['loss'][-1] - d:+.4f} | +0.0038 |" for r in trained]
        lines += [
            "",
            "Route drift of the dynamic run (scripts/route_diagnostics.py), per loop i against loop 1; "
            "paper at loop 4: kept 0.53, count cosine 0.978, routed cosine 0.767 (shifted 0.227), "
            "full cosine 0.918 (shifted 0.718).",
            "",
            "| loop i | kept | count cosine | routed cosine (shifted) | full cosine (shifted) |",
            "|---|---|---|---|---|",
        ]
        for i, m in dynamic["route_drift"].items():
            lines.append(
                f"| {i} | {m['kept']:.3f} | {m['count_cosine']:.3f} | {m['routed_cosine']:.3f} "
                f"({m['routed_cosine_shifted']:.3f}) | {m['full_cosine']:.3f} "
                f"({m['full_cosine_shifted']:.3f}) |"
            )
    return lines + [""]


def plot(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    base = results.get("baseline_matched")
    for group, (title, _) in GROUPS.items():
        members = [v for v, r in results.items() if group in r["groups"] and len(r["loss"]) > 1]
        if not members:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for v in members:
            r = results[v]
            ks = range(1, len(r["loss"]) + 1)
            ax.errorbar(ks, r["loss"], yerr=r["std"], marker="o", capsize=3, label=r["label"])
        if base:
            ax.axhline(base["loss"][0], color="black", linestyle="--", label=base["label"])
        ax.set(title=title, xlabel="loop count k", ylabel="validation loss (nats/byte)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"loss_vs_k_{group}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    points = tradeoff_points(results)
    if points:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for label, (one, gain) in points.items():  # bars: one paired sd over seeds each way
            x, y = 100 * one["mean"], 100 * gain["mean"]
            ax.errorbar(x, y, xerr=100 * one["sd"], yerr=100 * gain["sd"], marker="o", capsize=2, linewidth=0.8)
            ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axvline(0, color="black", linestyle="--", linewidth=0.8)
        ax.axhline(-1, color="gray", linestyle=":", linewidth=0.8)
        ax.set(
            title="One-loop parity against loop gain (wanted: left of the dashed line, below the dotted)",
            xlabel="k = 1 vs matched baseline (%, paired)",
            ylabel="best k vs own k = 1 (%, paired)",
        )
        ax.title.set_fontsize(8)
        fig.tight_layout()
        path = out / "tradeoff.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    elr = {v: r for v, r in results.items() if "loop_stats" in r}
    if elr:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for r in elr.values():
            norms = r["loop_stats"]["update_norm"]
            ax.plot(range(2, len(norms) + 1), norms[1:], marker="o", label=r["label"])
        ax.set(title="Update norm per loop at k = K", xlabel="loop i", ylabel="||s_i - s_(i-1)|| / ||s_(i-1)||")
        ax.legend(fontsize=6)
        fig.tight_layout()
        path = out / "update_norms.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
