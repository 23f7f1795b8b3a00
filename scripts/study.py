#!/usr/bin/env python
"""The evidence study: a matched baseline and ELR variants trained on the same tokens, each evaluated
at every loop count k, the paper's numbers beside ours (README "Does the recipe work?").

    python scripts/study.py --quick                 # 3 runs, one seed, about 5 minutes on 2 cores
    python scripts/study.py --seeds 0 1 2           # the full grid of train_configs/study/variants.toml
    python scripts/study.py --seeds 0 1 2 --report-only   # tables and plots from the finished runs

Every run is an ordinary checkpointed `train.py` run of train_configs/study/study.toml plus the
variant's overrides, in <runs>/<variant>/seed<N>: a finished run (final validation in its
metrics.jsonl) is skipped, an interrupted one resumes from its checkpoint. Runs go --jobs at a time,
one thread each. Without --data the study trains on the bundled prose re-encoded as bytes (same
text, same split as data/tinyprose), prepared once under <runs>/../data.

Writes <out>/results.json, <out>/results.md and the figures loss_vs_k_<group>.png, update_norms.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tomli

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elr.tokenizer import build_tokenizer, file_sha256  # noqa: E402
from route_diagnostics import route_drift  # noqa: E402

STUDY_CONFIG = ROOT / "train_configs/study/study.toml"
VARIANTS = ROOT / "train_configs/study/variants.toml"
BYTES_TOKENIZER = ROOT / "data/tokenizer/bytes.tiktoken"

# What each group reproduces, and the paper's numbers (arXiv 2610.12582; GPT-0.5B, K = 5, k = 1..5).
GROUPS = {
    "baseline": ("Baselines", "ELR k=1 should match the matched baseline (the paper: -0.52 points on ten tasks, 4B)."),
    "figure_4a": ("Figure 4a: update rule", "the learned step preserves one-loop accuracy and gains with loops; "
                  "parameter-free residual addition or replacement do worse."),
    "table_3": ("Table 3: loop sampling", "independent draws beat synchronized ones at every k (1.36x step time); "
                "among one-depth-per-update rows the 15% override is best."),
    "table_14": ("Table 14: recurrent-block input", "re-injecting h_in is slightly worse at every k."),
    "table_1": ("Tables 1 and 13: cross-loop route replay (MoE)", "replay costs little loss at k = K (+0.0038 "
                "trained with it, +0.0055 at inference only) and saves update time (-11.7% mixed depth, -19.6% at k = 4)."),
    "figure_6": ("Figure 6: late switch and conditioning", "a late switch with zero-initialised conditioning beats "
                 "mixed depth from scratch at the most loops (1.6147 vs 1.6273 at k = 5)."),
}
PAPER = {  # group -> variant -> validation loss at k = 1..5
    "table_3": {
    "sync_uniform": [1.7077, 1.6473, 1.6344, 1.6318, 1.6313],
    "indep_uniform": [1.6937, 1.6330, 1.6193, 1.6157, 1.6147],
    "sync_weighted": [1.6871, 1.6436, 1.6343, 1.6320, 1.6316],
    "default": [1.6830, 1.6391, 1.6299, 1.6278, 1.6273],
    "indep_weighted": [1.6774, 1.6334, 1.6231, 1.6200, 1.6194],
    },
    "table_14": {"default": [1.6830, 1.6391, 1.6299, 1.6278, 1.6273], "reinject": [1.6858, 1.6442, 1.6352, 1.6329, 1.6325]},
}
PAPER_BASELINE = 1.6852


def log(message: str) -> None:
    print(f"[study {time.strftime('%H:%M:%S')}] {message}", flush=True)


def byte_level_copy(src: Path, out: Path, src_tokenizer: Path) -> None:
    """Re-encode a prepared data folder as bytes (id = byte value, <|endoftext|> = 256).

    The documents, their order and the train/val split stay exactly as in `src`; only the
    tokenization changes, so a byte-level model sees the same text the BPE runs saw.
    """
    meta = json.loads((src / "meta.json").read_text())
    if meta.get("tokenizer_sha256") not in (None, file_sha256(src_tokenizer)):
        raise SystemExit(f"study: error: {src} was not tokenized with {src_tokenizer}")
    tokenizer = build_tokenizer(str(src_tokenizer))
    out.mkdir(parents=True, exist_ok=True)
    new_meta = {**meta, "vocab_size": 257, "eot_id": 256, "tokenizer": BYTES_TOKENIZER.name,
                "tokenizer_sha256": file_sha256(BYTES_TOKENIZER), "sources": [str(src)]}
    for split, info in meta["splits"].items():
        tokens = np.fromfile(src / info["file"], dtype=np.dtype(meta["dtype"]))
        ends = np.flatnonzero(tokens == meta["eot_id"])
        parts, start = [], 0
        for end in ends:
            text = tokenizer.encoding.decode_bytes(tokens[start:end].tolist())
            parts += [np.frombuffer(text, dtype=np.uint8).astype(np.uint16), np.array([256], dtype=np.uint16)]
            start = end + 1
        data = np.concatenate(parts)
        tmp = out / f".{info['file']}.tmp"
        data.tofile(tmp)
        os.replace(tmp, out / info["file"])
        new_meta["splits"][split] = {**info, "tokens": int(len(data))}
    (out / "meta.json").write_text(json.dumps(new_meta, indent=2) + "\n")  # last: marks the folder complete


@dataclass
class Run:
    variant: str
    seed: int
    folder: Path
    overrides: dict

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"


def cli_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def train_command(run: Run, data: Path, steps: int | None, val_steps: int | None) -> list[str]:
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(STUDY_CONFIG),
           "--job.dump_folder", str(run.folder), "--training.seed", str(run.seed), "--data.path", str(data)]
    if steps is not None:
        cmd += ["--training.steps", str(steps)]
    if val_steps is not None:
        cmd += ["--validation.steps", str(val_steps)]
    for key, value in run.overrides.items():
        cmd += [f"--{key}", cli_value(value)]
    return cmd


def read_records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_validation(folder: Path, steps: int) -> list[float] | None:
    """Validation loss at k = 1..K of the run's last step, or None if it has not finished."""
    for record in reversed(read_records(folder)):
        if record.get("step") == steps and "val/loss_k1" in record:
            return [record[f"val/loss_k{k}"] for k in range(1, 1 + sum(key.startswith("val/loss_k") for key in record))]
    return None


def train_all(runs: list[Run], data: Path, steps: int, args) -> list[Run]:
    """Run every unfinished run, --jobs at a time; returns the runs that failed."""
    todo = [r for r in runs if final_validation(r.folder, steps) is None]
    log(f"{len(runs) - len(todo)} of {len(runs)} runs already finished; training {len(todo)}, {args.jobs} at a time")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    running: list[tuple[Run, subprocess.Popen, float]] = []
    failed, done = [], 0
    while todo or running:
        while todo and len(running) < args.jobs:
            run = todo.pop(0)
            run.folder.mkdir(parents=True, exist_ok=True)
            with open(run.folder / "train.log", "a") as out:
                proc = subprocess.Popen(train_command(run, data, steps, args.val_steps), cwd=ROOT, env=env,
                                        stdout=out, stderr=subprocess.STDOUT)
            running.append((run, proc, time.monotonic()))
        time.sleep(1.0)
        for item in list(running):
            run, proc, start = item
            if proc.poll() is None:
                continue
            running.remove(item)
            done += 1
            losses = final_validation(run.folder, steps)
            if proc.returncode != 0 or losses is None:
                failed.append(run)
                log(f"FAILED {run.name} (exit {proc.returncode}); see {run.folder / 'train.log'}")
                continue
            log(f"[{done}/{done + len(todo) + len(running)}] {run.name}: {time.monotonic() - start:.0f} s, "
                f"val " + " ".join(f"k{k} {v:.4f}" for k, v in enumerate(losses, 1)))
    return failed


def latest_checkpoint(folder: Path) -> Path:
    steps = sorted((p for p in (folder / "checkpoint").glob("step-*") if (p / ".metadata").is_file()),
                   key=lambda p: int(p.name.split("-")[1]))
    if not steps:
        raise FileNotFoundError(f"{folder}: no checkpoint")
    return steps[-1]


def val_windows(data: Path, cfg: dict, batches: int):
    """The first validation batches of the run's shape: the same windows its own validation read."""
    from elr.train.data import val_batches

    t = cfg["training"]
    return val_batches(str(data / "val.bin"), t["seq_len"], t["local_batch_size"], batches, 0, 1)


def loop_statistics(model, batches) -> dict[str, list[float]]:
    """Per-loop update norm ||s_i - s_{i-1}|| / ||s_{i-1}||, step size and FiLM gate means at k = K,
    measured on validation batches with the run's final weights: a model that switched its later
    loops off shows norms near zero there."""
    import torch

    batches = list(batches)
    loops = model.args.max_loops
    model.recurrent.track_stats = True
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for inputs, _ in batches:
            model(inputs, loops=loops)
            for i, stats in enumerate(model.recurrent.loop_stats):
                for name, value in stats.items():
                    sums.setdefault(name, [0.0] * loops)[i] += value.item() / len(batches)
    model.recurrent.track_stats = False
    return sums


def summarise(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one seed)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def replay_at_inference_loss(model, batches) -> float:
    """Validation loss at k = K of a dynamically trained MoE run with route replay switched on,
    on the batches its own final validation used."""
    import torch

    from elr.train.loss import summed_loss

    model.recurrent.route_replay = True
    total = count = 0.0
    with torch.no_grad():
        for inputs, labels in batches:
            total += summed_loss(model(inputs, loops=model.args.max_loops), labels).item()
            count += labels.numel()
    model.recurrent.route_replay = False
    return total / count


def mean_per_key(dicts: list[dict]) -> dict:
    """Element-wise mean of equally shaped {key: list or {metric: value}} results over seeds."""
    first = dicts[0]
    if isinstance(first, dict):
        return {key: mean_per_key([d[key] for d in dicts]) for key in first}
    if isinstance(first, list):
        return [statistics.fmean(d[i] for d in dicts) for i in range(len(first))]
    return statistics.fmean(dicts)


def collect(runs: list[Run], variants: dict, data: Path, steps: int, stats_batches: int,
            val_steps: int | None) -> dict:
    results = {}
    for variant, spec in variants.items():
        # every finished seed counts: a grid cut short reports each variant over the seeds it has
        finished = [(r, final_validation(r.folder, steps)) for r in runs if r.variant == variant]
        finished = [(r, run_losses) for r, run_losses in finished if run_losses is not None]
        if not finished:
            continue
        mine, losses = [r for r, _ in finished], [run_losses for _, run_losses in finished]
        K = len(losses[0])
        per_k = [summarise([run_losses[k] for run_losses in losses]) for k in range(K)]
        entry = {"label": spec["label"], "groups": spec["groups"], "seeds": [r.seed for r in mine],
                 "loss": [m for m, _ in per_k], "std": [s for _, s in per_k], "per_seed": losses}
        replay_check = "table_1" in spec["groups"] and not spec["overrides"].get("moe.route_replay")
        if K > 1:  # one load of each run's final weights for every measurement below
            from elr.infer.load import load_model

            measured = []
            for r in mine:
                model, cfg = load_model(latest_checkpoint(r.folder))
                m = {"loop_stats": loop_statistics(model, val_windows(data, cfg, stats_batches))}
                if replay_check:
                    m["route_drift"] = route_drift(model, val_windows(data, cfg, stats_batches))
                    m["loss_replay_at_inference"] = replay_at_inference_loss(
                        model, val_windows(data, cfg, val_steps or cfg["validation"]["steps"]))
                measured.append(m)
            entry.update(mean_per_key(measured))
        results[variant] = entry
    return results


def fmt(mean: float, std: float, seeds: int) -> str:
    return f"{mean:.4f} ± {std:.4f}" if seeds > 1 else f"{mean:.4f}"


def rank_of(values: dict[str, float]) -> dict[str, int]:
    return {name: i + 1 for i, name in enumerate(sorted(values, key=values.get))}


def write_markdown(results: dict, out: Path, steps: int, seeds: list[int]) -> None:
    K = max(len(r["loss"]) for r in results.values())
    base = results.get("baseline_matched") or results.get("baseline")
    lines = [f"# ELR study results (seeds {', '.join(map(str, seeds))}; {steps} updates each)", "",
             "Validation loss (nats per byte) at each loop count k: mean ± standard deviation over the finished "
             "seeds. Δ compares k = 1 and the best k with the matched baseline's mean. Paper: arXiv 2610.12582, GPT-0.5B, K = 5 "
             f"(its baseline {PAPER_BASELINE}); its k = 1..{K} are shown. Made by `python scripts/study.py`.", ""]
    for group, (title, claim) in GROUPS.items():
        members = [v for v, r in results.items() if group in r["groups"]]
        if not members:
            continue
        if group == "table_1":
            lines += replay_section(results, members, title, claim)
            continue
        paper = PAPER.get(group, {})
        lines += [f"## {title}", "", f"Paper: {claim}", ""]
        header = ("| variant | seeds | " + " | ".join(f"k={k}" for k in range(1, K + 1))
                  + " | Δ k=1 / best k vs matched baseline |")
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
            delta = (f"{100 * (r['loss'][0] / base['loss'][0] - 1):+.2f}% / {100 * (min(r['loss']) / base['loss'][0] - 1):+.2f}%"
                     if base else "–")
            row = f"| {r['label']} | {len(r['seeds'])} | " + " | ".join(cells) + f" | {delta} |"
            if paper:
                if v in paper:
                    row += (f" {' / '.join(f'{x:.4f}' for x in paper[v][:len(r['loss'])])} |"
                            f" {rank_of(paper_1)[v]} / {rank_of(paper_k)[v]} | {rank_of(ours_1)[v]} / {rank_of(ours_k)[v]} |")
                else:
                    row += " – | – | – |"
            lines.append(row)
        lines.append("")
    elr = {v: r for v, r in results.items() if "loop_stats" in r}
    if elr:
        lines += ["## Later loops at work", "",
                  "Relative update norm ||s_i − s_{i−1}|| / ||s_{i−1}|| per loop i at k = K (loop 1 starts from the "
                  "embeddings, so its norm is large); FiLM gate mean 1 + g (1 = unconditioned).", "",
                  "| variant | " + " | ".join(f"norm loop {i}" for i in range(2, K + 1)) + " | gate mean, loops 1..K |",
                  "|" + "---|" * (K + 1)]
        for v, r in elr.items():
            norms = " | ".join(f"{x:.3f}" for x in r["loop_stats"]["update_norm"][1:])
            gates = r["loop_stats"].get("film_gate_mean")
            lines.append(f"| {r['label']} | {norms} | {' / '.join(f'{g:.2f}' for g in gates) if gates else '–'} |")
        lines.append("")
    (out / "results.md").write_text("\n".join(lines))


def replay_section(results: dict, members: list[str], title: str, claim: str) -> list[str]:
    lines = [f"## {title}", "", f"Paper: {claim}", "", "| routing | val loss k=K | Δ vs dynamic | paper Δ |", "|---|---|---|---|"]
    dynamic = next((results[v] for v in members if "loss_replay_at_inference" in results[v]), None)
    trained = [results[v] for v in members if results[v] is not dynamic]
    if dynamic:
        d = dynamic["loss"][-1]
        lines += [f"| dynamic | {d:.4f} | – | – |",
                  f"| replay at inference only | {dynamic['loss_replay_at_inference']:.4f} | "
                  f"{dynamic['loss_replay_at_inference'] - d:+.4f} | +0.0055 |"]
        lines += [f"| replay in training | {r['loss'][-1]:.4f} | {r['loss'][-1] - d:+.4f} | +0.0038 |" for r in trained]
        lines += ["", "Route drift of the dynamic run (scripts/route_diagnostics.py), per loop i against loop 1; "
                  "paper at loop 4: kept 0.53, count cosine 0.978, routed cosine 0.767 (shifted 0.227), "
                  "full cosine 0.918 (shifted 0.718).", "",
                  "| loop i | kept | count cosine | routed cosine (shifted) | full cosine (shifted) |", "|---|---|---|---|---|"]
        for i, m in dynamic["route_drift"].items():
            lines.append(f"| {i} | {m['kept']:.3f} | {m['count_cosine']:.3f} | {m['routed_cosine']:.3f} "
                         f"({m['routed_cosine_shifted']:.3f}) | {m['full_cosine']:.3f} ({m['full_cosine_shifted']:.3f}) |")
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
    elr = {v: r for v, r in results.items() if "loop_stats" in r}
    if elr:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for v, r in elr.items():
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the [quick] subset of variants.toml, one seed, fewer updates")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 (quick) or 0 1 2")
    p.add_argument("--variants", nargs="+", help="only these variants (default: all, or the quick subset)")
    p.add_argument("--steps", type=int, help="updates per run (default: study.toml's, or [quick] steps)")
    p.add_argument("--val-steps", type=int, help="validation microbatches per k (default: study.toml's)")
    p.add_argument("--data", type=Path, help="prepared data folder (default: the bundled prose as bytes)")
    p.add_argument("--runs", type=Path, default=ROOT / "outputs/study/runs", help="where the runs live")
    p.add_argument("--out", type=Path, default=ROOT / "docs/study", help="where results and figures go")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (one thread each)")
    p.add_argument("--stats-batches", type=int, default=4, help="validation batches for the loop statistics")
    p.add_argument("--report-only", action="store_true", help="no training: tabulate the finished runs")
    args = p.parse_args(argv)

    with open(VARIANTS, "rb") as f:
        variants = tomli.load(f)
    quick = variants.pop("quick")
    with open(STUDY_CONFIG, "rb") as f:
        steps = args.steps or (quick["steps"] if args.quick else tomli.load(f)["training"]["steps"])
    names = args.variants or (quick["variants"] if args.quick else list(variants))
    unknown = sorted(set(names) - set(variants))
    if unknown:
        p.error(f"unknown variants {unknown}; {VARIANTS.name} has {', '.join(variants)}")
    variants = {v: variants[v] for v in names}
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])

    data = args.data
    if data is None:
        data = args.runs.parent / "data"
        if not (data / "meta.json").is_file():
            log(f"re-encoding data/tinyprose as bytes into {data}")
            byte_level_copy(ROOT / "data/tinyprose", data, ROOT / "data/tokenizer/elr8k.tiktoken")
    if not (data / "meta.json").is_file():
        p.error(f"--data {data}: no meta.json (make it with scripts/prepare_data.py)")

    # seed by seed, so a grid cut short still has every variant at its first seeds
    runs = [Run(v, s, args.runs / v / f"seed{s}", spec["overrides"]) for s in seeds for v, spec in variants.items()]
    failed = [] if args.report_only else train_all(runs, data, steps, args)
    args.out.mkdir(parents=True, exist_ok=True)
    results = collect(runs, variants, data, steps, args.stats_batches, args.val_steps)
    if not results:
        log("no finished runs to report")
        return 1
    (args.out / "results.json").write_text(json.dumps({"steps": steps, "seeds": seeds, "results": results}, indent=2))
    write_markdown(results, args.out, steps, seeds)
    try:
        figures = plot(results, args.out)
    except ModuleNotFoundError as e:  # matplotlib is an extra: pip install -e ".[plot]"
        log(f"wrote {args.out / 'results.md'} and results.json; no figures: {e} (pip install -e \".[plot]\")")
        return 1
    log(f"wrote {args.out / 'results.md'}, results.json and {len(figures)} figures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
