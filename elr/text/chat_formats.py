"""The conversation formats people have, read into this package's messages and which turns train.

One JSONL record is one conversation, in one of these shapes (the record's other keys, such as an
id or a source, are ignored):

    messages            {"messages": [{"role": "system|user|assistant|tool", "content": ...}, ...]}
                        (also under "conversations", as some datasets name it)
    ShareGPT            {"conversations": [{"from": "system|human|gpt|tool", "value": ...}, ...]},
                        optionally with a top-level "system" string; "user"/"assistant" and
                        "function_call" (an assistant turn), "observation"/"function_response" (a tool
                        result) as other exports spell them
    prompt/completion   {"prompt": "...", "completion": "..."}: a user turn and an assistant turn; or
                        TRL's conversational form, {"prompt": [messages], "completion": [messages]}

Which tokens train: the assistant turns, each with the <|endoftext|> that closes it (elr/text/chat.py);
system, user and tool turns are context. In a prompt/completion record only the completion trains:
an assistant turn inside the prompt is context, as TRL's completion-only loss has it.

Tool use, OpenAI's shape: a `tool` message's content is the tool's result (its `tool_call_id` and
`name` are dropped); an assistant message's `tool_calls` ([{"function": {"name", "arguments"}}], or
the calls without the "function" wrapper) are written after its content, one line per call,
`<|tool_call|>{"name": ..., "arguments": {...}}` (arguments given as a JSON string are parsed), so a
model learns to emit them. Content given as a list of parts ([{"type": "text", "text": ...}]) is
joined; a part that is not text is refused. A record of no known shape, or a turn with a key or role
this reader does not know, is one DataError naming its file and line.
"""

from __future__ import annotations

import json

from elr.errors import DataError

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
SHAPES = ("messages", "conversations", "prompt")
TOOL_CALL = "<|tool_call|>"
# keys a message may carry besides role and content, by role; dropped once read (tool_calls rendered)
EXTRA_KEYS = {
    "assistant": {"tool_calls", "name"},
    "tool": {"tool_call_id", "name"},
    "user": {"name"},
    "system": {"name"},
}


def read_record(record, where: str) -> tuple[list[dict], list[bool]]:
    """(messages as [{"role", "content"}], per message whether its assistant turn trains) of one
    JSONL record; one DataError naming `where` for a record of no known shape."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    shapes = [key for key in SHAPES if key in record]
    if shapes == ["messages"]:
        messages = _messages(record["messages"], where, "messages")
        return messages, [True] * len(messages)
    if shapes == ["conversations"]:
        return _conversations(record, where)
    if shapes == ["prompt"] and "completion" in record:
        return _prompt_completion(record["prompt"], record["completion"], where)
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise DataError(
        f'{where}: not a conversation of a known shape (keys: {keys}); expected "messages", ShareGPT '
        '"conversations", or "prompt" with "completion" (docs/stages.md)'
    )


def _conversations(record: dict, where: str) -> tuple[list[dict], list[bool]]:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f'{where}: "conversations" must be a non-empty list')
    if all(isinstance(t, dict) and "role" in t for t in turns):  # messages under another name
        messages = _messages(turns, where, "conversations")
        return messages, [True] * len(messages)
    messages = []
    system = record.get("system")
    if system:
        if not isinstance(system, str):
            raise DataError(f'{where}: "system" must be a string')
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or set(turn) - {"from", "value"} or "from" not in turn or "value" not in turn:
            raise DataError(
                f'{where}: turn {i} of "conversations" must be an object with "from" and "value" '
                f'(ShareGPT) or "role" and "content", got {turn!r}'
            )
        if turn["from"] not in SHAREGPT_ROLES:
            raise DataError(f'{where}: turn {i} has unknown "from" {turn["from"]!r} (use {", ".join(SHAREGPT_ROLES)})')
        if not isinstance(turn["value"], str):
            raise DataError(f"{where}: turn {i}'s value is not a string")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages, [True] * len(messages)


def _prompt_completion(prompt, completion, where: str) -> tuple[list[dict], list[bool]]:
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], [False, True]
    if isinstance(prompt, list) and isinstance(completion, list):
        before, after = _messages(prompt, where, "prompt"), _messages(completion, where, "completion")
        if not any(m["role"] == "assistant" for m in after):
            raise DataError(f"{where}: the completion has no assistant turn (nothing to train on)")
        return before + after, [False] * len(before) + [True] * len(after)
    raise DataError(f'{where}: "prompt" and "completion" must both be strings or both be lists of messages')


def _messages(messages, where: str, field: str) -> list[dict]:
    """OpenAI-style messages as plain {"role", "content"}: parts joined, tool calls written out."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "{field}" must be a non-empty list')
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f'{where}: {field} message {i} must be an object with "role" and "content", got {m!r}')
        extra = set(m) - {"role", "content"} - EXTRA_KEYS.get(m["role"] if isinstance(m["role"], str) else "", set())
        if extra:
            raise DataError(
                f"{where}: {field} message {i} ({m['role']!r}) has unknown key(s) {', '.join(sorted(map(str, extra)))}"
            )
        if "content" not in m and not m.get("tool_calls"):
            raise DataError(f'{where}: {field} message {i} has no "content"')
        content = _text(m.get("content"), where, f"{field} message {i}")
        calls = [_tool_call(c, where, f"{field} message {i}") for c in m.get("tool_calls") or []]
        plain.append({"role": m["role"], "content": "\n".join(([content] if content else []) + calls)})
    return plain


def _text(content, where: str, what: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise DataError(f"{where}: {what}'s content is not a string or a list of text parts")


def _tool_call(call, where: str, what: str) -> str:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where}: {what} has a tool call without a function name: {call!r}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as the string it is
    return TOOL_CALL + json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
