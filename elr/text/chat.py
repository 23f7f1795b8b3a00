"""The chat template: one conversation -> token ids, and which of them the loss scores.

One template serves training data (scripts/prepare_data.py --format chat), chat inference
(elr/infer/chat.py) and a Hugging Face export (`CHAT_TEMPLATE`, the same text as Jinja). The bundled
tokenizer has one special token, <|endoftext|>, and adding tokens would change every checkpoint's
vocabulary, so the role markers are plain text and <|endoftext|> ends each assistant turn (decoding
stops at it, as elr/infer/generate.py already does):

    <|endoftext|><|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<|endoftext|>\\n ...

The leading <|endoftext|> is where a document starts in pretraining. Scored tokens (labels that are
not the ignore index) are those that start inside an assistant message's content, and the
<|endoftext|> that closes it; markers, system and user text are context only. Text is encoded as
ordinary text between the template's own <|endoftext|> tokens, so a message that spells
"<|endoftext|>" gets the characters, never the special token.
"""

from __future__ import annotations

from elr.errors import DataError
from elr.text.tokenizer import EOT, Tokenizer

ROLES = ("system", "user", "assistant", "tool")

# Jinja (Hugging Face's tokenizer.chat_template); `render` below is the same text, a test holds it.
# No newline follows a block tag, so Hugging Face's trim_blocks / lstrip_blocks render it the same.
CHAT_TEMPLATE = (
    "<|endoftext|>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ '<|endoftext|>' if message['role'] == 'assistant' else '' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def check_messages(messages, where: str, need_assistant: bool = True) -> list[dict]:
    """A list of {"role", "content"} with known roles and string contents, or one DataError naming
    `where` (a file and line). Training data needs an assistant turn; a chat prompt does not."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise DataError(f'{where}: message {i} must be an object with "role" and "content" only, got {m!r}')
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has unknown role {m['role']!r} (use {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {i}'s content is not a string")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn (nothing to train on)")
    return messages


def _pieces(
    messages: list[dict], add_generation_prompt: bool, trained: list[bool] | None = None
) -> list[tuple[str, bool, bool]]:
    """The rendering as (text, scored, special) pieces; special: the <|endoftext|> token itself.
    `trained[i]` false: message i is context even when it is the assistant's (a prompt's turns)."""
    pieces = [(EOT, False, True)]
    for i, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        scored = assistant and (trained is None or trained[i])
        pieces += [(f"<|{m['role']}|>\n", False, False), (m["content"], scored, False)]
        if assistant:
            pieces.append((EOT, scored, True))
        pieces.append(("\n", False, False))
    if add_generation_prompt:
        pieces.append(("<|assistant|>\n", False, False))
    return pieces


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text, exactly what CHAT_TEMPLATE renders."""
    return "".join(text for text, _, _ in _pieces(messages, add_generation_prompt))


def encode_conversation(
    messages: list[dict], tokenizer: Tokenizer, add_generation_prompt: bool = False, trained: list[bool] | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of `render(messages)` and, per token, whether the loss scores it (see the top; `trained`:
    per message, false for an assistant turn that is context, elr/text/chat_formats.py).

    The text between special tokens is encoded whole (so ids equal a tokenizer's encoding of the
    rendered string), and a token is scored when its first byte lies in a scored piece."""
    ids: list[int] = []
    scored: list[bool] = []
    run: list[tuple[str, bool]] = []  # ordinary pieces since the last special token

    def flush():
        text = "".join(t for t, _ in run)
        starts, offset = [], 0  # byte spans of the scored pieces
        for t, s in run:
            n = len(t.encode("utf-8"))
            if s:
                starts.append((offset, offset + n))
            offset += n
        position = 0
        for token in tokenizer.encode(text):
            ids.append(token)
            scored.append(any(a <= position < b for a, b in starts))
            position += len(tokenizer.encoding.decode_single_token_bytes(token))
        run.clear()

    for text, s, special in _pieces(messages, add_generation_prompt, trained):
        if special:
            flush()
            ids.append(tokenizer.eot_id)
            scored.append(s)
        else:
            run.append((text, s))
    flush()
    return ids, scored
