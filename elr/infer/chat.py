"""Chat with a fine-tuned checkpoint at any loop count k: one reply, a messages file, or a REPL.

Prompts use the training template (elr/text/chat.py) with the assistant marker appended; the reply is
decoded until <|endoftext|>, which closes every assistant turn in training. The REPL keeps the
conversation and changes k between requests (`/loops 3`): each reply is one request at one depth,
the same checkpoint serving every budget. `/loops auto` lets every reply token pick its own depth by
an exit rule (elr/models/early_exit.py; the REPL's `exit_rule`), capped at the model's K; the reply
line then says the mean loops its tokens ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from elr.errors import DataError
from elr.infer.generate import GREEDY, AdaptiveDepth, Sampling, generate
from elr.models.early_exit import ExitRule
from elr.text.chat import check_messages, encode_conversation
from elr.text.json_text import parse_json

HELP = (
    "commands: /loops N (the loop count of the next replies; auto: each token picks its depth), "
    "/system TEXT (set the system message), /reset (forget the conversation), /quit"
)
DEFAULT_EXIT = ExitRule(
    "kl", 0.01
)  # /loops auto, and the server's "auto", without a rule given (untuned: pass one per model)


def reply(
    model,
    tokenizer,
    messages: list[dict],
    loops: int,
    max_new_tokens: int,
    kv_mode: str = "per_loop",
    sampling: Sampling = GREEDY,
    generator=None,
    adaptive: AdaptiveDepth | None = None,
    compile: bool = False,
) -> str:
    """The assistant's next message after `messages`, decoded at k = loops (with `adaptive`: each
    token at the depth its exit rule picks, capped at loops; `compile`: through the compiled step)."""
    ids, _ = encode_conversation(messages, tokenizer, add_generation_prompt=True)
    if len(ids) + max_new_tokens > model.args.max_seq_len:
        raise ValueError(
            f"the conversation ({len(ids)} tokens) plus {max_new_tokens} new tokens is past the model's "
            f"context of {model.args.max_seq_len} tokens; start again (/reset) or shorten it"
        )
    out = generate(
        model,
        [ids],
        loops,
        max_new_tokens,
        tokenizer.eot_id,
        kv_mode,
        sampling,
        generator,
        adaptive=adaptive,
        compile=compile,
    )[0]
    return tokenizer.decode(out)


def read_messages(path: str | Path) -> list[dict]:
    """A JSON list of {"role", "content"} ending in a turn to answer (not an assistant's), or one DataError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise DataError(f"--messages: {path} is not a readable JSON list of messages ({e})") from None
    messages = parse_json(text, f"--messages {path}")
    check_messages(messages, f"--messages {path}", need_assistant=False)
    if messages[-1]["role"] == "assistant":
        raise DataError(f"--messages {path}: the last message is the assistant's; end with a user message")
    return messages


def repl(
    model,
    tokenizer,
    loops: int,
    max_new_tokens: int,
    stdin: TextIO,
    stdout: TextIO,
    kv_mode: str = "per_loop",
    sampling: Sampling = GREEDY,
    generator=None,
    exit_rule: ExitRule = DEFAULT_EXIT,
    compile: bool = False,
) -> None:
    """Read user turns (and commands) line by line until /quit or end of input; print each reply."""
    messages: list[dict] = []
    auto = False
    print(f"chat at k={loops}; {HELP}", file=stdout, flush=True)
    for line in stdin:
        text = line.strip()
        if not text:
            continue
        command, _, arg = text.partition(" ")
        if command == "/quit":
            break
        if command == "/reset":
            messages = [m for m in messages if m["role"] == "system"]
            print("(conversation cleared)", file=stdout, flush=True)
        elif command == "/system":
            messages = [{"role": "system", "content": arg}] + [m for m in messages if m["role"] != "system"]
        elif command == "/loops" and arg == "auto":
            auto, loops = True, model.args.recurrence.max_loops
            print(f"(k=auto: exit rule {exit_rule}, at most {loops} loops)", file=stdout, flush=True)
        elif command == "/loops":
            if not arg.isdigit() or int(arg) < 1:
                print(f"/loops takes a loop count >= 1 or auto, not {arg!r}", file=stdout, flush=True)
                continue
            auto, loops = False, int(arg)
            print(f"(k={loops})", file=stdout, flush=True)
        elif command.startswith("/"):
            print(f"unknown command {command}; {HELP}", file=stdout, flush=True)
        else:
            depth = AdaptiveDepth(exit_rule) if auto else None
            try:
                answer = reply(
                    model,
                    tokenizer,
                    [*messages, {"role": "user", "content": text}],
                    loops,
                    max_new_tokens,
                    kv_mode,
                    sampling,
                    generator,
                    depth,
                    compile,
                )
            except ValueError as e:  # e.g. a k past a conditioned model's K: say so, keep the conversation
                print(f"error: {e}", file=stdout, flush=True)
                continue
            messages.append({"role": "user", "content": text})
            messages.append({"role": "assistant", "content": answer})
            k = loops if not auto else f"auto, {depth.mean_loops:.2f} loops per token" if depth.tokens else "auto"
            print(f"assistant (k={k}): {answer}", file=stdout, flush=True)
