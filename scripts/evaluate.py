"""Evaluate one checkpoint at several loop counts k: validation loss, multiple-choice accuracy, latency.

    python scripts/evaluate.py --checkpoint outputs/debug/checkpoint/step-150 --loops 1,2,3 \\
        --tasks outputs/tasks/piqa.jsonl outputs/tasks/openbookqa.jsonl --limit 200 --out outputs/debug/eval.json
        # the task files: python scripts/convert_mc_tasks.py ... --out outputs/tasks, or make_cloze_task.py
    python scripts/evaluate.py ... --baseline outputs/base/checkpoint/step-150   # adds a baseline column

Validation loss uses the run's prepared data folder (or --data; a chat folder scores the assistant
tokens of its validation conversations, as the trainer's validation does); tasks are JSONL files (see
elr/infer/evaluate.py, scripts/convert_mc_tasks.py and scripts/make_cloze_task.py). Latency: time
to first token of a fixed prompt and per-token decode, each also relative to k=1. Prints a Markdown
table and writes it, with the JSON, next to --out; scripts/plot_loops.py draws figures from the JSON.
A run trained on a depth task (data.task) is scored instead on its task's validation examples: answer
accuracy at each difficulty and k (an unconditioned model also beyond its K: --loops 1,2,...,8).

Adaptive depth (`--exit state:0.05 kl:0.01 ...`, elr/models/early_exit.py): each rule, capped at the
largest k, scores the same metrics (validation loss, decoded loss per KV mode, task accuracy) with the
mean loops its tokens ran beside each; a second table ("exit rule" columns) and the JSON's "adaptive"
hold them, to read against the fixed-k columns at the same mean loops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from elr.cli import HelpFormatter
from elr.console.progress import Progress
from elr.errors import UserError
from elr.infer.kv_modes import MODES
from elr.text.chat_data import is_chat_folder

if TYPE_CHECKING:
    from elr.models.early_exit import ExitRule

LATENCY_TEXT = "The old king walked slowly through the quiet garden, thinking of the years behind him. "


def parse_loops(text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--loops takes loop counts like 1,2,3, not {text!r}") from None


def evaluate(
    checkpoint: str, loops: list[int] | None, args, exits: list[ExitRule] = ()
) -> tuple[dict, dict[str, dict[int, float]], dict[str, dict[str, float]]]:
    """Run config, {metric: {k: value}} for one checkpoint (loops None: every k in 1..K) and, per exit
    rule capped at the largest k, {rule: {metric: value, metric/mean_loops: loops}}."""
    import torch

    from elr.infer.evaluate import (
        chat_validation_loss,
        decoded_loss,
        load_task,
        measure_latency,
        read_tokens,
        score_multiple_choice,
        task_accuracy,
        validation_loss,
    )
    from elr.infer.generate import AdaptiveDepth
    from elr.infer.load import load_model, load_tokenizer
    from elr.text.tasks import build_task

    model, cfg = load_model(checkpoint, args.device, getattr(torch, args.dtype))
    if args.route_replay:
        model.route_replay = True
    loops = loops or list(range(1, model.args.recurrence.max_loops + 1))
    rows: dict[str, dict[int, float]] = {}
    adaptive: dict[str, dict[str, float]] = {str(rule): {} for rule in exits}

    def score(rule: ExitRule, metric: str, run) -> None:
        """One metric under an exit rule: run(AdaptiveDepth) gives its value; the mean loops go beside it."""
        depth = AdaptiveDepth(rule)
        adaptive[str(rule)][metric] = run(depth)
        adaptive[str(rule)][f"{metric}/mean_loops"] = depth.mean_loops

    if cfg["data"].get("task"):  # a depth-task run: answer accuracy per difficulty, nothing text-based
        d = cfg["data"]
        task = build_task(d["task"], d["task_items"], d["task_max_difficulty"])
        for k in loops:
            accuracy = task_accuracy(model, task, cfg["training"]["seed"], args.task_examples, k)
            rows.setdefault(f"{task.name}/acc", {})[k] = sum(accuracy) / len(accuracy)
            for difficulty, value in enumerate(accuracy, 1):
                rows.setdefault(f"{task.name}/acc_d{difficulty}", {})[k] = value
            print(f"k={k}: accuracy " + " ".join(f"{a:.3f}" for a in accuracy), file=sys.stderr)
        for rule in exits:
            depth = AdaptiveDepth(rule)
            accuracy = task_accuracy(
                model, task, cfg["training"]["seed"], args.task_examples, max(loops), adaptive=depth
            )
            for metric, value in [
                ("acc", statistics.fmean(accuracy)),
                *((f"acc_d{d}", a) for d, a in enumerate(accuracy, 1)),
            ]:
                adaptive[str(rule)][f"{task.name}/{metric}"] = value
                adaptive[str(rule)][f"{task.name}/{metric}/mean_loops"] = depth.mean_loops
        return cfg, rows, adaptive
    tokenizer = load_tokenizer(cfg, args.tokenizer)
    sources = cfg["data"].get("sources") or []  # a mixture's run: its first source's validation split
    data = args.data or (sources[0].get("val_path") or sources[0]["path"] if sources else cfg["data"]["path"])
    val_path = Path(data) / "val.bin"  # a split of the folder: the older file, or the val shards
    if not Path(data).is_dir():
        val_path = Path(__file__).resolve().parents[1] / data / "val.bin"
    chat = is_chat_folder(val_path.parent)  # conversations: the loss on their assistant tokens
    tokens = read_tokens(val_path) if (args.val_batches or args.decoded_windows) and not chat else None
    tasks = {Path(path).stem: load_task(path)[: args.limit or None] for path in args.tasks}
    prompt = ([tokenizer.eot_id] + tokenizer.encode(LATENCY_TEXT * 64))[: args.latency_prompt_tokens]
    progress = Progress("evaluate", len(loops), "loop counts")  # one-line counter with ETA, on stderr
    for k in loops:
        if args.val_batches and not chat:
            rows.setdefault("val_loss", {})[k] = validation_loss(
                model, tokens, cfg["training"]["seq_len"], k, args.val_batches, args.batch_size
            )
        elif args.val_batches and chat:
            rows.setdefault("val_loss", {})[k] = chat_validation_loss(
                model, val_path.parent, cfg["training"]["seq_len"], k, args.val_batches, args.batch_size
            )
        for mode in MODES if tokens is not None and args.decoded_windows else ():
            rows.setdefault(f"val_loss_decoded/{mode}", {})[k] = decoded_loss(
                model, tokens, cfg["training"]["seq_len"], k, mode, args.decoded_windows
            )
        for name, items in tasks.items():
            result = score_multiple_choice(model, tokenizer, items, k, args.batch_size)
            rows.setdefault(f"{name}/acc", {})[k] = result["acc"]
            rows.setdefault(f"{name}/acc_norm", {})[k] = result["acc_norm"]
            for mode in MODES if args.decoded_tasks else ():
                result = score_multiple_choice(model, tokenizer, items, k, kv_mode=mode)
                rows.setdefault(f"{name}/acc_decoded/{mode}", {})[k] = result["acc"]
                rows.setdefault(f"{name}/acc_norm_decoded/{mode}", {})[k] = result["acc_norm"]
        if args.latency_new_tokens:
            latency = measure_latency(model, prompt, k, args.kv, args.latency_new_tokens, compile=args.compile_latency)
            for name, seconds in latency.items():
                rows.setdefault(f"latency/{name}", {})[k] = seconds
        print(f"k={k}: " + ", ".join(f"{m} {v[k]:.4g}" for m, v in rows.items()), file=sys.stderr)
        progress.update()
    progress.close()
    seq_len = cfg["training"]["seq_len"]
    for rule in exits:
        if args.val_batches and not chat:
            score(
                rule,
                "val_loss",
                lambda depth: validation_loss(
                    model, tokens, seq_len, max(loops), args.val_batches, args.batch_size, depth
                ),
            )
        for mode in MODES if tokens is not None and args.decoded_windows else ():
            score(
                rule,
                f"val_loss_decoded/{mode}",
                lambda depth: decoded_loss(model, tokens, seq_len, max(loops), mode, args.decoded_windows, depth),
            )
        for name, items in tasks.items():
            score(
                rule,
                f"{name}/acc",
                lambda depth: score_multiple_choice(
                    model, tokenizer, items, max(loops), args.batch_size, adaptive=depth
                )["acc"],
            )
        print(f"exit {rule}: " + ", ".join(f"{m} {v:.4g}" for m, v in adaptive[str(rule)].items()), file=sys.stderr)
    return cfg, rows, adaptive


def with_relative_latency(rows: dict[str, dict[int, float]], reference: dict[str, dict[int, float]]) -> None:
    """Add latency rows relative to the reference's k=1 (the same run, or the ELR run for a baseline)."""
    for name in ("ttft_s", "decode_s_per_token"):
        if f"latency/{name}" in rows:
            one = reference[f"latency/{name}"][1]
            rows[f"latency/{name}_rel"] = {k: v / one for k, v in rows[f"latency/{name}"].items()}


def markdown(loops: list[int], rows: dict, baseline: dict | None) -> str:
    head = "| metric | " + " | ".join(f"k={k}" for k in loops) + (" | baseline |" if baseline else " |")
    lines = [head, "|---" * (len(loops) + 1 + bool(baseline)) + "|"]
    for metric, values in rows.items():
        cells = [f"{values[k]:.4g}" for k in loops]
        if baseline:
            cells.append(f"{baseline[metric][1]:.4g}" if metric in baseline else "")
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def adaptive_markdown(adaptive: dict[str, dict[str, float]], cap: int) -> str:
    rules = list(adaptive)
    metrics = list(dict.fromkeys(m for values in adaptive.values() for m in values))
    lines = [
        "| metric | " + " | ".join(f"exit {r} (cap k={cap})" for r in rules) + " |",
        "|---" * (len(rules) + 1) + "|",
    ]
    for metric in metrics:
        lines.append(
            f"| {metric} | "
            + " | ".join(f"{adaptive[r][metric]:.4g}" if metric in adaptive[r] else "" for r in rules)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", required=True, help="step-N (DCP) or step-N-model (export) folder")
    p.add_argument(
        "--loops",
        type=parse_loops,
        help="loop counts, e.g. 1,2,3 (default: every k in 1..K; an "
        "unconditioned model also runs k > K, extrapolating)",
    )
    p.add_argument(
        "--task-examples",
        type=int,
        default=1024,
        help="depth-task runs: validation examples scored per k (default %(default)s)",
    )
    p.add_argument("--kv", choices=MODES, default="per_loop", help="KV cache mode for latency (default per_loop)")
    p.add_argument("--tasks", nargs="*", default=[], help="multiple-choice JSONL files")
    p.add_argument("--limit", type=int, default=0, help="first N questions of each task (0: all)")
    p.add_argument(
        "--data",
        help="prepared data folder whose val split is read (default: the run config's; a mixture's first source)",
    )
    p.add_argument("--val-batches", type=int, default=4, help="validation batches (0: skip the loss)")
    p.add_argument(
        "--decoded-windows",
        type=int,
        default=0,
        help="validation windows whose second half is decoded token by token in each KV mode "
        "(val_loss_decoded/<mode>; 0: skip)",
    )
    p.add_argument(
        "--decoded-tasks",
        action="store_true",
        help="also score each task's options decoded token by token through the cache in each KV mode "
        "(<task>/acc_decoded/<mode>: what a served model picks)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument(
        "--latency-prompt-tokens", type=int, default=64, help="prompt length of the decode-latency measurement"
    )
    p.add_argument("--latency-new-tokens", type=int, default=16, help="decode steps timed (0: skip latency)")
    p.add_argument(
        "--compile-latency",
        action="store_true",
        help="time the decode steps through the compiled step over a static cache (elr/infer/decode.py), so "
        "the latency rows measure the model rather than per-token overhead (the compile is not timed)",
    )
    p.add_argument(
        "--exit",
        nargs="*",
        default=[],
        metavar="RULE:T",
        help="adaptive depth: also score under each exit rule (state:T, kl:T), capped at the largest k",
    )
    p.add_argument("--baseline", help="checkpoint of a non-recurrent baseline, evaluated at k=1")
    p.add_argument("--route-replay", action="store_true", help="force MoE route replay on at inference")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype the model runs in")
    p.add_argument("--tokenizer", help="tokenizer file (default: the run config's)")
    p.add_argument("--out", type=Path, help="write the results JSON here and the table beside it (.md)")
    args = p.parse_args(argv)

    import torch

    if args.compile_latency:
        from elr.infer.decode import use_compile_cache

        use_compile_cache()

    from elr.models.early_exit import ExitRule

    try:  # parsed once the arguments are known: --help and usage errors need no torch
        args.exit = [ExitRule.parse(rule) for rule in args.exit]
    except ValueError as e:
        p.error(f"argument --exit: {e}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    try:
        _, rows, adaptive = evaluate(args.checkpoint, args.loops, args, args.exit)
        loops = sorted(next(iter(rows.values()))) if rows else (args.loops or [])
        baseline = None
        if args.baseline:
            _, baseline, _ = evaluate(args.baseline, [1], args)
            with_relative_latency(baseline, rows)
        with_relative_latency(rows, rows)
    except (UserError, FileNotFoundError, ValueError) as e:  # user errors: one line
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    table = markdown(loops, rows, baseline)
    if adaptive:
        table += "\n\n" + adaptive_markdown(adaptive, max(loops))
    print(table)
    if args.out:
        result = {
            "checkpoint": args.checkpoint,
            "kv": args.kv,
            "loops": loops,
            "rows": rows,
            "baseline": {"checkpoint": args.baseline, "rows": baseline} if baseline else None,
            "adaptive": adaptive,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
