"""JSON from a user's file, as text a tokenizer can encode: one DataError naming where, never a traceback.

Two things `json.loads` accepts or fails on that no caller should meet: an escape such as "\\ud800", half of a
UTF-16 surrogate pair, decodes to a string that is not text (UTF-8 cannot encode it, so hashing or tokenizing
it fails later, far from the line that held it); and brackets nested deeper than the parser's recursion
limit raise RecursionError.
"""

from __future__ import annotations

import json
import re

from elr.errors import DataError

_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(text: str, where: str) -> object:
    """The JSON value of `text`, or one DataError starting with `where` ("file.jsonl:12")."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested deeper than the parser reads (brackets inside brackets)") from None
    bad = lone_surrogate(value)
    if bad is not None:
        raise DataError(
            f"{where}: holds the lone surrogate \\u{ord(bad):04x}, half of a UTF-16 pair that is not a character "
            "(write the character itself, or both halves of its escape)"
        )
    return value


def lone_surrogate(value: object) -> str | None:
    """The first lone surrogate in any string (key or value) of a parsed JSON value, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if found := _SURROGATE.search(item):
                return found[0]
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None
