"""Generate text from a trained ELR checkpoint at one or several loop counts k.

    python scripts/generate.py        # right after `python train.py`: its newest checkpoint, k = K, one prompt
    python scripts/generate.py --checkpoint outputs/debug/checkpoint/step-150 --loops 3 \\
        --kv last_loop --prompt "Once upon a time" --max-new-tokens 64 --temperature 0
    python scripts/generate.py --checkpoint ... --loops 1,2,3 --prompt "..."   # the same prompt at each depth
    python scripts/generate.py --checkpoint ... --budgets 1,3 --prompt "A" --prompt "B"   # a k per prompt, one batch
    python scripts/generate.py --checkpoint ... --loops 3 --draft-loops 1 --prompt "..."   # self-speculative
    python scripts/generate.py --checkpoint ... --exit kl:0.01 --prompt "..."   # adaptive depth, capped at K
    python scripts/generate.py --checkpoint ... --compile on --max-new-tokens 1024   # the compiled decode step
    python scripts/generate.py --checkpoint ... --memory 131072                # KV/state bytes per request
    python scripts/generate.py --flavor koi_4b --loops 4 --memory 131072 --dtype bfloat16
    python scripts/generate.py --checkpoint outputs/sft_debug/checkpoint/step-80 --chat --loops 3   # REPL
    python scripts/generate.py --checkpoint ... --messages chat.json --loops 1,3   # one reply per k

For each k it prints a header line with tokens/s, then the generated text; the last line printed is
the text generated at the last k. Several --prompt flags decode as one left-padded batch. Each prompt
begins with <|endoftext|>, as every training document does (and as the export's tokenizer and both
lm-eval paths begin them).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

# Only what the arguments need is imported here: --help and a usage error come in a moment. torch and the
# model code are imported once the arguments are known (`heavy`).
from elr.cli import HelpFormatter
from elr.config import DEFAULT_CONFIG, load_config
from elr.errors import UserError
from elr.infer.kv_modes import MODES

DEFAULT_PROMPT = "Once upon a time"


def quick_start_checkpoint() -> Path | None:
    """The newest committed step of `python train.py` run from this directory (the default config's
    dump folder), so generating right after the quick start needs no flags; None if there is none."""
    cfg = load_config(DEFAULT_CONFIG)
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    if not folder.is_dir() or not any(re.fullmatch(r"step-\d+", p.name) for p in folder.iterdir()):
        return None  # found without importing torch: the usage error says so at once
    from elr.checkpoint import latest_step

    step = latest_step(folder)
    return folder / f"step-{step}" if step is not None else None


def parse_loops(text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--loops takes loop counts like 3 or 1,2,3, not {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--checkpoint",
        help="step-N (DCP), step-N-model or Hugging Face export folder (default: the newest "
        "checkpoint of `python train.py` run from this directory, outputs/debug/checkpoint)",
    )
    p.add_argument(
        "--loops",
        type=parse_loops,
        help="k, or several as 1,2,3 (default: the model's K, max_loops, as evaluate.py and the export)",
    )
    p.add_argument(
        "--budgets", type=parse_loops, help="one k per --prompt (mixed budgets in one batch; replaces --loops)"
    )
    p.add_argument(
        "--draft-loops",
        type=int,
        metavar="J",
        help="self-speculative greedy decoding: draft at k=J, verify at each --loops k (elr/infer/speculative.py)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=4,
        metavar="N",
        help="with --draft-loops: tokens drafted per verifying forward (default 4)",
    )
    p.add_argument(
        "--exit",
        metavar="RULE:THRESHOLD",
        help="adaptive depth: each new token stops looping when the rule says (state:T, kl:T), "
        "capped at each --loops k; in --chat, the rule of /loops auto",
    )
    p.add_argument("--kv", choices=MODES, default="per_loop", help="KV cache mode (default per_loop)")
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="decode through the compiled step over a static cache (elr/infer/decode.py; the same tokens): auto "
        "compiles when this command's decoding steps are enough to pay for the compile (elr.infer.decode."
        "compile_pays: about 20,000 steps on a CPU; in --chat, a session of replies, on a GPU only); kernels are "
        "kept in outputs/inductor-cache",
    )
    p.add_argument("--prompt", action="append", help=f"prompt text; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0: no top-k cut")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold; 1: off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--route-replay",
        action="store_true",
        help="force MoE route replay on (on anyway when the model was trained with it)",
    )
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype the model runs in")
    p.add_argument("--tokenizer", help="tokenizer file (default: the run config's)")
    p.add_argument(
        "--memory",
        type=int,
        metavar="TOKENS",
        help="print KV-cache and GDP-state bytes per request of TOKENS tokens and exit",
    )
    p.add_argument("--flavor", help="with --memory: a named flavor instead of a checkpoint (elr/models/args.py)")
    p.add_argument("--chat", action="store_true", help="chat on stdin with the chat template (elr/infer/chat.py)")
    p.add_argument("--messages", help="JSON list of messages: print the assistant's reply at each k")
    args = p.parse_args(argv)
    if args.exit is not None and args.loops is not None and max(args.loops) < 2:
        p.error("--exit stops each token's loops early: it needs a cap of at least 2 loops (drop --loops for K)")
    if args.memory is not None and args.memory < 1:
        p.error(f"--memory takes a token count of at least 1, not {args.memory}")
    if not -(2**63) <= args.seed < 2**64:  # what torch's generator takes
        p.error(f"--seed must lie in -2^63..2^64-1, not {args.seed}")
    if (args.chat or args.messages) and args.checkpoint:
        return chat_main(args, p)
    if not args.checkpoint and not (args.memory is not None and args.flavor):
        args.checkpoint = quick_start_checkpoint()
        if args.checkpoint is None:
            p.error("--checkpoint is required (or --memory with --flavor); `python train.py` run here saves one")
        print(f"generate: no --checkpoint given: the quick start's newest, {args.checkpoint}", file=sys.stderr)

    import torch  # the arguments are known: now the model code

    from elr.infer.decode import compile_pays, use_compile_cache
    from elr.infer.generate import AdaptiveDepth, Sampling, generate
    from elr.infer.load import load_model, load_tokenizer, run_config
    from elr.infer.memory import check_fits, memory_table
    from elr.infer.speculative import speculative_generate
    from elr.models import flavors

    parse_exit_and_device(args, p)
    if args.memory is not None and args.flavor:
        if args.flavor not in flavors:
            p.error(f"--flavor: unknown flavor {args.flavor!r}; one of {', '.join(sorted(flavors))}")
        dtype = getattr(torch, args.dtype)
        flavor = flavors[args.flavor]
        print(memory_table(flavor, max(args.loops or [flavor.recurrence.max_loops]), args.memory, dtype))
        return 0
    if not args.prompt and not args.memory:
        args.prompt = [DEFAULT_PROMPT]

    dtype = getattr(torch, args.dtype)
    try:
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        if args.draft_loops is not None and (args.temperature > 0 or args.budgets is not None or args.exit):
            raise ValueError("--draft-loops decodes greedily at one k: drop --temperature, --budgets and --exit")
        if args.exit is not None and args.budgets is not None:
            raise ValueError("--exit caps every prompt at one k: use --loops, not --budgets")
        tokenizer = None
        if args.memory is None:
            tokenizer = load_tokenizer(run_config(args.checkpoint), args.tokenizer)
            prompts = [[tokenizer.eot_id] + tokenizer.encode(text) for text in args.prompt]  # as documents begin
            if args.budgets is not None and len(args.budgets) != len(prompts):
                raise ValueError(f"--budgets gives {len(args.budgets)} loop counts for {len(prompts)} prompts")
            longest = max(len(t) for t in prompts) + args.max_new_tokens
        model, _ = load_model(args.checkpoint, args.device, dtype)
        args.loops = args.loops or [model.args.recurrence.max_loops]
        if args.memory is None:  # the cache is sized up front: refuse what the device cannot hold, in one line
            loops = model.args.recurrence.max_loops if args.exit else max(args.budgets or args.loops)
            check_fits(model.args, loops, longest, args.kv, dtype, len(prompts), args.device)
            model.extend_positions(longest)
    except (UserError, FileNotFoundError, ValueError) as e:  # user errors: one line
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    if args.memory is not None:
        print(memory_table(model.args, max(args.loops + [model.args.recurrence.max_loops]), args.memory, dtype))
        return 0
    if args.route_replay:
        model.route_replay = True
    steps = args.max_new_tokens * len([args.budgets] if args.budgets is not None else args.loops)
    compiled = args.compile == "on" or (args.compile == "auto" and compile_pays(steps, args.device))
    if compiled:
        use_compile_cache()
        print("generate: the decode step compiles on its first token (kept in outputs/inductor-cache)", file=sys.stderr)

    for k in [args.budgets] if args.budgets is not None else args.loops:
        generator = torch.Generator(args.device).manual_seed(args.seed)
        start = time.perf_counter()
        note = ""
        try:
            if args.draft_loops is not None:
                outputs, stats = speculative_generate(
                    model,
                    prompts,
                    k,
                    args.max_new_tokens,
                    tokenizer.eot_id,
                    args.kv,
                    args.draft_loops,
                    args.draft_tokens,
                    compile=compiled,
                )
                note = f" draft k={args.draft_loops}: {stats.acceptance:.0%} of {stats.drafted} drafts accepted,"
            else:
                depth = AdaptiveDepth(args.exit) if args.exit is not None else None
                outputs = generate(
                    model,
                    prompts,
                    k,
                    args.max_new_tokens,
                    tokenizer.eot_id,
                    args.kv,
                    sampling,
                    generator,
                    adaptive=depth,
                    compile=compiled,
                )
                if depth is not None:
                    note = f" exit {args.exit}: {depth.mean_loops:.2f} loops per new token,"
        except (UserError, ValueError) as e:
            print(f"generate: error: {e}", file=sys.stderr)
            return 2
        elapsed = time.perf_counter() - start
        n_tokens = sum(len(o) for o in outputs)
        k = ",".join(map(str, k)) if isinstance(k, list) else k
        rate = f"{n_tokens} tokens in {elapsed:.2f} s, {n_tokens / elapsed:.1f} tokens/s"
        print(f"--- k={k} kv={args.kv}:{note} {rate}")
        for i, out in enumerate(outputs):  # with --budgets each row says its own k
            label = f"[k={args.budgets[i]}] " if args.budgets is not None else ""
            print(label + tokenizer.decode(out).replace("\n", " "))
    return 0


def parse_exit_and_device(args, p: argparse.ArgumentParser) -> None:
    """--exit as an ExitRule (a usage error if it is none) and --device's default, once torch is imported."""
    import torch

    from elr.models.early_exit import ExitRule

    if args.exit is not None:
        try:
            args.exit = ExitRule.parse(args.exit)
        except ValueError as e:
            p.error(f"argument --exit: {e}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def chat_main(args, p: argparse.ArgumentParser) -> int:
    """--chat (a REPL at k = the first --loops, `/loops N` to change it) or --messages FILE."""
    import torch

    from elr.infer import chat
    from elr.infer.decode import compile_pays, use_compile_cache
    from elr.infer.generate import Sampling
    from elr.infer.load import load_model, load_tokenizer, run_config

    parse_exit_and_device(args, p)
    try:
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        messages = chat.read_messages(args.messages) if args.messages else None
        tokenizer = load_tokenizer(run_config(args.checkpoint), args.tokenizer)
        model, _ = load_model(args.checkpoint, args.device, getattr(torch, args.dtype))
        args.loops = args.loops or [model.args.recurrence.max_loops]
        generator = torch.Generator(args.device).manual_seed(args.seed)
        steps = args.max_new_tokens * len(args.loops)
        compiled = args.compile == "on" or (
            args.compile == "auto"
            and (compile_pays(steps, args.device) if messages is not None else torch.device(args.device).type == "cuda")
        )
        if compiled:
            use_compile_cache()
            print(
                "generate: the decode step compiles on the first reply (kept in outputs/inductor-cache)",
                file=sys.stderr,
            )
        if messages is None:
            chat.repl(
                model,
                tokenizer,
                args.loops[0],
                args.max_new_tokens,
                sys.stdin,
                sys.stdout,
                args.kv,
                sampling,
                generator,
                args.exit or chat.DEFAULT_EXIT,
                compiled,
            )
        for k in args.loops if messages is not None else []:
            print(
                f"--- k={k}\n"
                + chat.reply(
                    model, tokenizer, messages, k, args.max_new_tokens, args.kv, sampling, generator, compile=compiled
                )
            )
    except (UserError, FileNotFoundError, ValueError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
