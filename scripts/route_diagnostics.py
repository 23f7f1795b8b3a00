#!/usr/bin/env python
"""How far MoE routes drift between loops on a trained checkpoint (elr/tools/route_diagnostics.py).

python scripts/route_diagnostics.py outputs/study/text/runs/moe_dynamic/seed0/checkpoint/step-600
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from elr.cli import HelpFormatter
from elr.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a DCP checkpoint folder (step-N) of an MoE ELR run")
    p.add_argument("--data", type=Path, help="prepared data folder (default: the run config's)")
    p.add_argument("--batches", type=int, default=4, help="validation microbatches")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args(argv)

    from elr.tools.route_diagnostics import drift_for_checkpoint

    try:
        drift = drift_for_checkpoint(args.checkpoint, args.data, args.batches)
    except (UserError, FileNotFoundError, ValueError) as e:  # user errors: one line
        print(f"route_diagnostics: error: {e}", file=sys.stderr)
        return 2
    print("| loop i | kept | count cosine | routed cosine (shifted) | full cosine (shifted) |")
    print("|---|---|---|---|---|")
    for i, m in drift.items():
        print(
            f"| {i} | {m['kept']:.3f} | {m['count_cosine']:.3f} | {m['routed_cosine']:.3f} "
            f"({m['routed_cosine_shifted']:.3f}) | {m['full_cosine']:.3f} ({m['full_cosine_shifted']:.3f}) |"
        )
    if args.json:
        args.json.write_text(json.dumps(drift, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
