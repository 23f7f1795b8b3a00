"""Serve a checkpoint over the OpenAI API, each request at its own loop budget (docs/serving.md).

    python scripts/serve.py --checkpoint outputs/debug/checkpoint/step-150      # http://127.0.0.1:8000/v1
    python scripts/serve.py --checkpoint koi4b-hf --device cuda --dtype bfloat16 --kv last_loop_kv \\
        --default-loop-budget 2 --max-concurrent 32 --max-auto 8 --exit kl:0.01
    python scripts/serve.py --checkpoint outputs/debug/checkpoint/step-150 --max-auto 0 --max-draft 0 --port 8100

Then any OpenAI client works, the budget as an extra body field:

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "debug-step-150", "prompt": "The king", "max_tokens": 16, "loop_budget": 3}'
    client.chat.completions.create(model=..., messages=[...], extra_body={"loop_budget": "auto"})

The server binds 127.0.0.1 unless --host says otherwise. It prints the inference memory it holds
(rows x one request's state at the full context) before it starts. Every request is bounded before
anything is allocated for it (the --max-* flags; docs/serving.md lists every field, limit and error): a
malformed one gets 400, a body past --max-body-bytes 413, a request that would wait past --max-wait-s
429 with a Retry-After. SIGTERM or Ctrl-C drains: new requests get 503, the running ones finish (up to
--drain-timeout-s); a second signal stops at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Only what the arguments need is imported here: --help and a usage error come at once; torch, the model code
# and the server once the arguments are known.
from elr.cli import HelpFormatter, argument_type
from elr.errors import UserError
from elr.infer.kv_modes import MODES
from elr.serve.limits import Limits


def parse_budget(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"a loop budget is an integer k >= 1 or auto, not {text!r}")
    return int(text)


def model_name(checkpoint: str) -> str:
    """The name clients ask for: the folder's, with the run's for a `step-N` checkpoint (run-step-N)."""
    path = Path(checkpoint).resolve()
    return f"{path.parent.parent.name}-{path.name}" if path.name.startswith("step-") else path.name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", required=True, help="step-N (DCP), step-N-model or Hugging Face export folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument(
        "--default-loop-budget",
        type=argument_type(parse_budget),
        help="k (or auto) of a request that gives no loop_budget (default: the model's K)",
    )
    p.add_argument(
        "--exit",
        metavar="RULE:THRESHOLD",
        help='the exit rule of loop_budget "auto" (state:T or kl:T), capped at K (default: chat\'s, kl:0.01, '
        "untuned: pick one per model with scripts/evaluate.py --exit)",
    )
    p.add_argument(
        "--max-concurrent", type=int, default=Limits.max_concurrent, help="choices decoded at a fixed k at once (rows)"
    )
    p.add_argument(
        "--max-auto",
        type=int,
        default=Limits.max_auto,
        help="choices decoded with loop_budget auto at once (0: refuse auto)",
    )
    p.add_argument(
        "--max-draft",
        type=int,
        default=Limits.max_draft,
        help="self-speculative requests at once (0: refuse draft_loops)",
    )
    p.add_argument("--draft-tokens", type=int, default=Limits.draft_tokens, help="tokens drafted per verifying round")
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=Limits.max_queued_tokens,
        help="prompt + max_tokens of the waiting requests past which a request gets 429",
    )
    p.add_argument(
        "--max-wait-s",
        type=float,
        default=Limits.max_wait_s,
        help="expected wait for a row (the work ahead at the measured step time) past which a request gets 429 "
        "with a Retry-After (0: no such check)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=Limits.max_body_bytes,
        help="bytes of a request body, counted as it is read: past them 413",
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, help="tokens of one prompt or conversation (default: the context less one)"
    )
    p.add_argument(
        "--max-stop-chars", type=int, default=Limits.max_stop_chars, help="characters of one stop string (up to 4)"
    )
    p.add_argument(
        "--max-prefill-bytes",
        type=int,
        help="memory the prompts read in one step may hold beside the rows (prefill cache and logits); a request "
        "needing more gets 400 (default: one prompt at the full context)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=Limits.drain_timeout_s,
        help="after SIGTERM or Ctrl-C, how long the running requests may take to finish (new ones get 503)",
    )
    p.add_argument("--kv", choices=MODES, default="per_loop", help="KV cache mode (docs/inference.md)")
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="decode through the compiled step over static caches (elr/infer/decode.py; the same tokens), each "
        "graph compiled on first use and kept in outputs/inductor-cache; auto: on a GPU (CUDA graphs), off on a "
        "CPU, where the first requests of each shape wait for a compile (docs/serving.md)",
    )
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype the model runs in")
    p.add_argument("--tokenizer", help="tokenizer file (default: the run config's)")
    p.add_argument("--served-model-name", help="the model id clients give (default: from the checkpoint's folder)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level")
    args = p.parse_args(argv)
    import torch  # the arguments are known: now the model code

    from elr.infer.chat import DEFAULT_EXIT
    from elr.models.early_exit import ExitRule

    try:
        args.exit = ExitRule.parse(args.exit) if args.exit else DEFAULT_EXIT
    except ValueError as e:
        p.error(f"argument --exit: {e}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import uvicorn

        from elr.serve.api import Server, create_app
        from elr.serve.protocol import Served
        from elr.serve.scheduler import Engine
    except ImportError as e:
        if (e.name or "").split(".")[0] not in ("fastapi", "starlette", "pydantic", "uvicorn"):
            raise
        print(f'serve: error: {e.name} is missing; install the serve extra: pip install -e ".[serve]"', file=sys.stderr)
        return 2
    from elr.infer.decode import use_compile_cache
    from elr.infer.load import load_model, load_tokenizer, run_config

    try:
        limits = Limits(
            args.max_concurrent,
            args.max_auto,
            args.max_draft,
            args.max_queued_tokens,
            args.draft_tokens,
            args.max_wait_s,
            args.max_body_bytes,
            args.max_prompt_tokens,
            args.max_stop_chars,
            args.max_prefill_bytes,
            args.drain_timeout_s,
        )
        limits.check()  # before the model is loaded
        tokenizer = load_tokenizer(run_config(args.checkpoint), args.tokenizer)
        model, _ = load_model(args.checkpoint, args.device, getattr(torch, args.dtype))
        max_loops = model.args.recurrence.max_loops
        default = args.default_loop_budget or max_loops
        if default != "auto" and default > max_loops:
            raise ValueError(f"--default-loop-budget {default} is past the model's K = {max_loops}")
        compile = args.compile == "on" or (args.compile == "auto" and torch.device(args.device).type == "cuda")
        if compile:
            use_compile_cache()
        engine = Engine(model, tokenizer.eot_id, tokenizer.decode, args.kv, limits, args.exit, compile)
    except (UserError, FileNotFoundError, ValueError) as e:  # user errors: one line
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    served = Served(
        args.served_model_name or model_name(args.checkpoint),
        tokenizer,
        model.args.max_seq_len,
        max_loops,
        default,
        limits,
    )
    print(
        f"serve: {served.model_name} (K={max_loops}, context {served.context}, default loop budget {default}) on "
        f"http://{args.host}:{args.port}/v1\nserve: {engine.memory_report()}",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(create_app(engine, served), host=args.host, port=args.port, log_level=args.log_level)
    Server(config, engine, limits.drain_timeout_s).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
