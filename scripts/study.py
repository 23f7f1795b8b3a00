#!/usr/bin/env python
"""The evidence study: matched baselines, untied controls and ELR variants trained alike, each
evaluated at every loop count k (docs/study/README.md; the library is scripts/study_tools/).

    python scripts/study.py --suite depth --quick       # pointer chasing, one seed: under 15 min on 2 cores
    python scripts/study.py --suite depth --seeds 0 1 2 # the depth suite -> docs/study/depth
    python scripts/study.py --quick                     # the text suite's quick subset, one seed
    python scripts/study.py --seeds 0 1 2               # the text grid -> docs/study/text
    python scripts/study.py ... --report-only           # tables and figures from the finished runs
    python scripts/study.py ... --carry docs/study/text/results.json  # rows of runs not kept here, named as such
    python scripts/study.py --corpus code --variants ...  # the text suite on Python source as bytes

A suite is train_configs/study/<suite>.toml plus the variants of <suite>_variants.toml. Runs live in
outputs/study/<suite>[-quick|-custom]/runs/<variant>/seed<N>: finished ones are skipped, interrupted
ones resume. Only the full grid at the suite's own length writes docs/study/<suite> (committed);
a quick run, a subset of variants or other --steps writes beside its runs unless --out says where.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from study_tools import depth_report, text_report
from study_tools.byte_data import bundled_prose_as_bytes, python_source_as_bytes
from study_tools.protocol import plan
from study_tools.runs import ROOT, SUITES, Run, Suite, earlier_rows, log, train_all

from elr.cli import HelpFormatter
from elr.errors import ConfigError

COMMITTED = {"text": ROOT / "docs/study/text", "depth": ROOT / "docs/study/depth"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--suite", choices=SUITES, default="text", help="text (the paper's ablations) or depth (tasks)")
    p.add_argument("--quick", action="store_true", help="the suite's [quick] subset, one seed, fewer updates")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 (quick) or 0 1 2")
    p.add_argument("--variants", nargs="+", help="only these variants (default: all, or the quick subset)")
    p.add_argument("--steps", type=int, help="updates per run (default: the suite's, or [quick] steps)")
    p.add_argument("--val-steps", type=int, help="validation microbatches per k (default: the suite config's)")
    p.add_argument(
        "--corpus",
        choices=("prose", "code"),
        default="prose",
        help="text suite: the bundled prose as bytes, or the Python standard library's source as bytes "
        "(a second kind of data, made on first use; runs under outputs/study/text-code)",
    )
    p.add_argument("--data", type=Path, help="text suite: prepared data folder (default: the --corpus as bytes)")
    p.add_argument(
        "--runs", type=Path, help="where the runs live (default: outputs/study/<suite>[-quick|-custom]/runs)"
    )
    p.add_argument(
        "--out",
        type=Path,
        help="where results and figures go (default: docs/study/<suite> for the full grid, else beside the runs)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (one thread each)")
    p.add_argument("--stats-batches", type=int, default=4, help="text: validation batches for the loop statistics")
    p.add_argument(
        "--extrapolation-examples",
        type=int,
        default=1024,
        help="depth: examples per k when scoring unconditioned runs past K (0: skip)",
    )
    p.add_argument("--report-only", action="store_true", help="no training: tabulate the finished runs")
    p.add_argument(
        "--carry",
        type=Path,
        metavar="RESULTS_JSON",
        help="take the rows of variants with no finished run here from this earlier report "
        "(same suite and --steps); the report names them",
    )
    args = p.parse_args(argv)

    suite = Suite.load(args.suite)
    steps = args.steps or (suite.quick["steps"] if args.quick else suite.steps)
    names = args.variants or (suite.quick["variants"] if args.quick else list(suite.variants))
    unknown = sorted(set(names) - set(suite.variants))
    if unknown:
        p.error(f"unknown variants {unknown}; the {args.suite} suite has {', '.join(suite.variants)}")
    try:  # each protocol member's FLOPs against its group's baseline, a FLOPs-matched run's updates
        variants = plan(suite.config, suite.variants, suite.protocols, names, steps)
    except ConfigError as e:
        p.error(str(e))
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    code = args.suite == "text" and args.corpus == "code"
    full_grid = not args.quick and args.variants is None and steps == suite.steps and not code
    tag = "-code" * code + ("" if full_grid else ("-quick" if args.quick and args.steps is None else "-custom"))
    base = ROOT / "outputs/study" / f"{args.suite}{tag}"
    runs_dir = args.runs or base / "runs"
    out = args.out or (COMMITTED[args.suite] if full_grid else base)

    earlier = {}
    if args.carry:
        try:
            earlier = earlier_rows(args.carry, args.suite, steps)
        except ValueError as e:
            p.error(str(e))

    data = None
    if args.suite == "text":
        data = args.data or (
            python_source_as_bytes(ROOT / "outputs/study/code-data")
            if code
            else bundled_prose_as_bytes(ROOT / "outputs/study/data")
        )
        if not (data / "meta.json").is_file():
            p.error(f"--data {data}: no meta.json (make it with scripts/prepare_data.py)")

    # seed by seed, so a grid cut short still has every variant at its first seeds
    runs = [
        Run(v, s, runs_dir / v / f"seed{s}", spec["overrides"], spec.get("steps", steps))
        for s in seeds
        for v, spec in variants.items()
    ]
    failed = [] if args.report_only else train_all(runs, suite.config, data, args.jobs, args.val_steps)
    out.mkdir(parents=True, exist_ok=True)
    if args.suite == "text":
        results = text_report.collect(runs, variants, data, args.stats_batches, args.val_steps)
    else:
        import tomli

        with open(suite.config, "rb") as f:
            task = tomli.load(f)["data"]
        results = depth_report.collect(runs, variants, task["task_max_difficulty"], args.extrapolation_examples)
    carried = [v for v in names if v not in results and v in earlier]
    results = {v: results[v] if v in results else earlier[v] for v in names if v in results or v in carried}
    if args.carry:
        log(f"carried {len(carried)} variant(s) from {args.carry}: {' '.join(carried) or '-'}")
    if not results:
        log("no finished runs to report")
        return 1
    (out / "results.json").write_text(
        json.dumps(
            {
                "suite": args.suite,
                "corpus": args.corpus if args.suite == "text" else None,
                "steps": steps,
                "seeds": seeds,
                "carried": carried,
                "results": results,
            },
            indent=2,
        )
    )
    try:
        if args.suite == "text":
            text_report.write_markdown(results, out, steps, seeds, carried, "code" if code else "prose")
            figures = text_report.plot(results, out)
        else:
            depth_report.write_markdown(results, out, steps, seeds, task["task"], carried)
            figures = [depth_report.plot(results, out)]
    except ModuleNotFoundError as e:  # matplotlib is an extra: pip install -e ".[plot]"
        log(f'wrote {out / "results.json"}; no report: {e} (pip install -e ".[plot]")')
        return 1
    log(f"wrote {out / 'results.md'}, results.json and {len(figures)} figure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
