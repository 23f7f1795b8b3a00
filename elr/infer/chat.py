"""Chat with a fine-tuned checkpoint at any loop count k: one reply, a messages file, or a REPL.

Prompts use the training template (elr/chat.py) with the assistant marker appended; the reply is
decoded until <|endoftext|>, which closes every assistant turn in training. The REPL keeps the
conversation and changes k between requests (`/loops 3`): each reply is one request at one depth,
the same checkpoint serving every budget.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from elr.chat import check_messages, encode_conversation
from elr.errors import DataError
from elr.infer.generate import Sampling, generate

HELP = ("commands: /loops N (the loop count of the next replies), /system TEXT (set the system message), "
        "/reset (forget the conversation), /quit")


def reply(model, tokenizer, messages: list[dict], loops: int, max_new_tokens: int, kv_mode: str = "per_loop",
          sampling: Sampling = Sampling(), generator=None) -> str:
    """The assistant's next message after `messages`, decoded at k = loops."""
    ids, _ = encode_conversation(messages, tokenizer, add_generation_prompt=True)
    if len(ids) + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"the conversation ({len(ids)} tokens) plus {max_new_tokens} new tokens is past the model's "
                         f"context of {model.args.max_seq_len} tokens; start again (/reset) or shorten it")
    out = generate(model, [ids], loops, max_new_tokens, tokenizer.eot_id, kv_mode, sampling, generator)[0]
    return tokenizer.decode(out)


def read_messages(path: str | Path) -> list[dict]:
    """A JSON list of {"role", "content"} ending in a turn to answer (not an assistant's), or one DataError."""
    try:
        messages = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"--messages: {path} is not a readable JSON list of messages ({e})") from None
    check_messages(messages, f"--messages {path}", need_assistant=False)
    if messages[-1]["role"] == "assistant":
        raise DataError(f"--messages {path}: the last message is the assistant's; end with a user message")
    return messages


def repl(model, tokenizer, loops: int, max_new_tokens: int, stdin: TextIO, stdout: TextIO,
         kv_mode: str = "per_loop", sampling: Sampling = Sampling(), generator=None) -> None:
    """Read user turns (and commands) line by line until /quit or end of input; print each reply."""
    messages: list[dict] = []
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
        elif command == "/loops":
            if not arg.isdigit() or int(arg) < 1:
                print(f"/loops takes a loop count >= 1, not {arg!r}", file=stdout, flush=True)
                continue
            loops = int(arg)
            print(f"(k={loops})", file=stdout, flush=True)
        elif command.startswith("/"):
            print(f"unknown command {command}; {HELP}", file=stdout, flush=True)
        else:
            try:
                answer = reply(model, tokenizer, [*messages, {"role": "user", "content": text}], loops,
                               max_new_tokens, kv_mode, sampling, generator)
            except ValueError as e:  # e.g. a k past a conditioned model's K: say so, keep the conversation
                print(f"error: {e}", file=stdout, flush=True)
                continue
            messages.append({"role": "user", "content": text})
            messages.append({"role": "assistant", "content": answer})
            print(f"assistant (k={loops}): {answer}", file=stdout, flush=True)
