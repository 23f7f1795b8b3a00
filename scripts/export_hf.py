"""Export a checkpoint as a Hugging Face folder: safetensors weights, config.json, tokenizer.json, remote code.

    python scripts/export_hf.py --checkpoint outputs/debug/checkpoint/step-150 --out outputs/debug/hf
    python scripts/export_hf.py --checkpoint ... --out ... --dtype bfloat16 --loops 3 --kv last_loop
    python scripts/export_hf.py --seal outputs/debug/hf   # rehash an export you edited by hand (or made before hashes)

The folder loads in transformers with `AutoModelForCausalLM.from_pretrained(out)` after
`import elr.interop.hf_model` (which registers the classes; no remote code runs), and in this package's
own loaders (generate.py, evaluate.py, checkpoint.initial_load_path), which check the SHA-256 of every
file it lists in elr_sha256.json first. Share this folder, not the DCP checkpoint. An existing --out,
or an OUT.tmp this script did not make, is refused and left as it is.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from elr.cli import HelpFormatter
from elr.errors import CheckpointError, UserError
from elr.infer.kv_modes import MODES

_SIZE = re.compile(r"(\d+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"--max-shard-size takes a size like 5GB or 500MiB, not {text!r}")
    return int(m[1]) * _UNITS[(m[2] or "b").lower()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", help="step-N (DCP), step-N-model, or an export folder (required unless --seal)")
    p.add_argument("--out", type=Path, help="the folder to write (must not exist; required unless --seal)")
    p.add_argument(
        "--seal",
        type=Path,
        metavar="FOLDER",
        help="instead of exporting, write elr_sha256.json for an "
        "export you vouch for (edited by hand, or made before exports carried hashes), then check it",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights' dtype in the export")
    p.add_argument("--loops", type=int, help="default loop count of forward/generate (default: the model's max_loops)")
    p.add_argument(
        "--kv",
        choices=MODES,
        default="per_loop",
        help="default KV cache mode of generate (measure a model before serving last_loop_kv: docs/inference.md)",
    )
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="split weights above this (default 5GB)")
    p.add_argument(
        "--chat-template",
        type=Path,
        help="a Jinja chat template file for tokenizer_config.json "
        "(default: the template SFT trains with, elr/text/chat.py)",
    )
    p.add_argument("--tokenizer", help="tokenizer file (default: the run config's)")
    args = p.parse_args(argv)

    import torch

    from elr.infer.load import load_model, load_tokenizer
    from elr.interop import write_export

    if args.seal:
        return seal_main(args.seal)
    if not args.checkpoint or not args.out:
        p.error("--checkpoint and --out are required (or --seal FOLDER)")
    try:
        model, cfg = load_model(args.checkpoint, note=False)
        tokenizer = load_tokenizer(cfg, args.tokenizer)
        template = {"chat_template": args.chat_template.read_text()} if args.chat_template else {}
        out = write_export(
            model.state_dict(),
            model.args,
            cfg,
            tokenizer,
            args.out,
            dtype=getattr(torch, args.dtype),
            loops=args.loops,
            kv=args.kv,
            max_shard_bytes=args.max_shard_size,
            **template,
        )
    except (UserError, FileNotFoundError, ValueError) as e:  # user errors: one line
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {out}")
    return 0


def seal_main(folder: Path) -> int:
    """--seal: hash the export's files as they are now, then run the checks a loader runs."""
    from elr.interop import check_export, is_export
    from elr.interop.hf_hashes import seal_folder

    try:
        if not is_export(folder):
            raise CheckpointError(f"{folder} is not an ELR export (no config.json with model_type elr)")
        names = seal_folder(folder)
        check_export(folder)
    except UserError as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"sealed {folder}: {len(names)} files hashed into elr_sha256.json; it loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
