"""Every config key with its type, default and doc, read from the dataclasses of elr/config/job.py.

One source: each section's docstring holds one `key: meaning` entry per field. `train.py --help`
prints them and the README's configuration table is this module's `markdown_table()` (a test
checks the README holds exactly that table, and that every field has its entry).

    python -m elr.config.reference --markdown     # the README table, to paste after a change
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing

from elr.config import JobConfig

_ENTRY = re.compile(r"^    (\w+): (.*)$")


def key_docs(section_cls) -> dict[str, str]:
    """{field name: its one-line doc} from the docstrings of the section and its bases (continuation
    lines joined), bases first, as dataclass fields are ordered: [elr]'s recurrence options are
    documented where they are defined (elr/config/recurrence.py)."""
    docs, current = {}, None
    lines = [line for cls in reversed(section_cls.__mro__) for line in (cls.__dict__.get("__doc__") or "").splitlines()]
    for line in lines:
        if m := _ENTRY.match(line):
            current = m.group(1)
            docs[current] = m.group(2).strip()
        elif current and line.startswith("        "):
            docs[current] += " " + line.strip()
        else:
            current = None
    return docs


def type_name(typ) -> str:
    if typing.get_origin(typ) is list:
        return f"list[{typing.get_args(typ)[0].__name__}]"
    return typ.__name__


def show_default(value) -> str:
    """TOML spelling: strings quoted, booleans lower case, lists in brackets."""
    return json.dumps(value) if isinstance(value, (str, bool, list)) else repr(value)


def config_keys() -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """[(section, section summary, [(name, type, default, doc), ...]), ...] in the dataclasses' order."""
    sections = []
    for s in dataclasses.fields(JobConfig):
        cls = s.default_factory
        hints, defaults, docs = typing.get_type_hints(cls), cls(), key_docs(cls)
        keys = [(f.name, type_name(hints[f.name]), show_default(getattr(defaults, f.name)), docs.get(f.name, ""))
                for f in dataclasses.fields(cls)]
        sections.append((s.name, (cls.__doc__ or "").strip().splitlines()[0], keys))
    return sections


def help_text() -> str:
    """The config part of `train.py --help`: every key, `--section.key TYPE (default D)  doc`."""
    lines = ["config keys (--section.key VALUE or --section.key=VALUE; CLI > TOML > defaults; a bare boolean",
             "key is true; lists comma-separated, e.g. --optimizer.betas 0.9,0.95; dashes or underscores):"]
    for section, _, keys in config_keys():
        lines.append(f"\n  [{section}]")
        for name, typ, default, doc in keys:
            lines.append(f"  --{section}.{name} {typ.upper()} (default {default})")
            lines.append(f"      {doc}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The README's configuration table."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for section, _, keys in config_keys():
        rows.append(f"| **[{section}]** | | |")
        rows += [f"| `{name}` | `{default}` | {doc} |" for name, _, default, doc in keys]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table() if "--markdown" in sys.argv[1:] else help_text())
