"""The warning for lm-eval's stock `hf` model run on an ELR export without `add_bos_token=True`.

ELR models are trained on documents that start after `<|endoftext|>`, and this package's scoring
(scripts/evaluate.py, lm-eval's "elr" model) puts it before every context. lm-eval's `hf` model adds
a BOS token only when told (`add_bos_token=True`); without it the scores are lower and the loop counts
read alike. `python -m elr.infer.lm_eval_adapter` checks its command line and says so.
"""

from __future__ import annotations

from elr.interop.hf_config import is_export

HF_MODELS = ("hf", "hf-auto", "huggingface")


def model_args(text: str) -> dict[str, str]:
    """lm-eval's `--model_args a=1,b=x` as {a: "1", b: "x"}."""
    pairs = [item.split("=", 1) for item in text.split(",") if "=" in item]
    return {key.strip(): value.strip() for key, value in pairs}


def missing_bos_warning(argv: list[str]) -> str | None:
    """The warning for an lm-eval command line (`--model hf --model_args pretrained=<ELR export>,...`
    without add_bos_token=True), or None."""
    options = {}
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in ("--model", "--model_args"):
            options[key] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    args = model_args(options.get("--model_args", ""))
    if options.get("--model") not in HF_MODELS or not is_export(args.get("pretrained", "")):
        return None
    if args.get("add_bos_token", "").lower() == "true":
        return None
    return (
        f"warning: {args['pretrained']} is an ELR export, trained with <|endoftext|> before every document; "
        "lm-eval's hf model adds it only with add_bos_token=True in --model_args (without it the scores are "
        "lower and the loop counts read alike)"
    )
