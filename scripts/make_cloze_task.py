"""Cut a cloze multiple-choice task from a prepared data folder's held-out tokens.

    python scripts/make_cloze_task.py --data data/tinyprose --items 400 --out outputs/tasks/cloze.jsonl
    python scripts/evaluate.py --checkpoint CKPT --tasks outputs/tasks/cloze.jsonl --decoded-tasks

Each item is one window of val.bin: its first --context-tokens tokens are the context, the next
--option-tokens the right option, and the same span of other windows the wrong ones. Public
benchmarks leave a model of a few million parameters at chance; this task does not, so accuracy can
move with k and with the KV mode. Windows that cross a document boundary are skipped.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from elr.cli import HelpFormatter
from elr.config import JobConfig
from elr.errors import UserError
from elr.text.tokenizer import Tokenizer, build_tokenizer


def cloze_items(
    tokens, tokenizer: Tokenizer, items: int, context_tokens: int, option_tokens: int, choices: int, seed: int
) -> list[dict]:
    """Evenly spaced windows of `tokens` as {"context", "choices", "answer"} items; wrong options
    are other windows' continuations, drawn and placed with `seed`."""
    span = context_tokens + option_tokens
    windows = [
        start
        for start in range(0, len(tokens) - span + 1, span)
        if tokenizer.eot_id not in tokens[start : start + span]
    ]
    if len(windows) < max(items, choices):
        raise ValueError(
            f"{len(tokens)} held-out tokens give {len(windows)} windows of {span} without a "
            f"document boundary; {max(items, choices)} are needed"
        )
    continuation = {w: tokenizer.decode(tokens[w + context_tokens : w + span].tolist()) for w in windows}
    distinct = sorted(set(continuation.values()))
    if len(distinct) < choices:
        raise ValueError(
            f"the held-out text has {len(distinct)} different continuations; {choices} choices need as many"
        )
    rng, result = random.Random(seed), []
    for i in range(items):
        start = windows[round(i * (len(windows) - 1) / max(items - 1, 1))]
        right = continuation[start]
        options = rng.sample([text for text in distinct if text != right], choices - 1)
        answer = rng.randrange(choices)
        options.insert(answer, right)
        result.append(
            {
                "context": tokenizer.decode(tokens[start : start + context_tokens].tolist()),
                "choices": options,
                "answer": answer,
            }
        )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data", required=True, help="prepared data folder (val.bin and meta.json)")
    p.add_argument(
        "--tokenizer", help="tokenizer file (default: the one meta.json records, found as train.py finds it)"
    )
    p.add_argument("--items", type=int, default=400, help="items to write (default %(default)s)")
    p.add_argument(
        "--context-tokens", type=int, default=48, help="tokens of text before the options (default %(default)s)"
    )
    p.add_argument("--option-tokens", type=int, default=8, help="tokens per option (default %(default)s)")
    p.add_argument("--choices", type=int, default=4, help="options per item (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draws the wrong options and the answer's place")
    p.add_argument("--out", type=Path, required=True, help="JSONL task file to write")
    args = p.parse_args(argv)

    from elr.data.job_data import job_tokenizer_path
    from elr.data.token_files import check_tokenizer
    from elr.infer.evaluate import read_tokens

    try:
        if args.items < 1 or args.choices < 2 or args.context_tokens < 1 or args.option_tokens < 1:
            raise ValueError("--items, --context-tokens and --option-tokens must be positive, --choices at least 2")
        cfg = JobConfig()  # the trainer's own lookup and check of a data folder's tokenizer
        cfg.data.path, cfg.tokenizer.path = args.data, args.tokenizer or ""
        tokenizer = build_tokenizer(job_tokenizer_path(cfg))
        check_tokenizer(Path(args.data), tokenizer, cfg)
        items = cloze_items(
            read_tokens(Path(args.data) / "val.bin"),
            tokenizer,
            args.items,
            args.context_tokens,
            args.option_tokens,
            args.choices,
            args.seed,
        )
    except (UserError, OSError, ValueError) as e:
        print(f"make_cloze_task: error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")  # a crash leaves no half-written task
    partial.write_text("".join(json.dumps(item) + "\n" for item in items))
    partial.replace(args.out)
    print(f"{len(items)} items, {args.choices} options each -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
