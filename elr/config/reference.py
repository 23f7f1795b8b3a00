"""Every config key with its type, default and doc, read from the dataclasses of elr/config/job.py.

One source: the string under each field is its meaning, as torchtitan's config dataclasses do it, and a choice
key's values are its `Literal[...]` annotation. `train.py --help` prints them and the configuration table of
docs/configuration.md is this module's `markdown_table()` (a test checks the page holds exactly that table, and
that every field has its entry). Needs no torch.

    python -m elr.config.reference --markdown     # docs/configuration.md's table, to paste after a change
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing

from elr.config import JobConfig


def key_docs(section_cls) -> dict[str, str]:
    """{field name: its doc} from the string under each field (lines joined), bases first, as dataclass
    fields are ordered: [elr]'s recurrence options are documented where they are defined
    (elr/config/recurrence.py)."""
    docs = {}
    for cls in reversed(section_cls.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for field_node, doc_node in zip(body, body[1:]):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(doc_node, ast.Expr)
                and isinstance(doc_node.value, ast.Constant)
                and isinstance(doc_node.value.value, str)
            ):
                docs[field_node.target.id] = " ".join(doc_node.value.value.split())
    return docs


def type_name(typ) -> str:
    """`int`, `list[float]`, ...; a choice key: its values, `{adamw,muon}` (the empty string spelt `""`)."""
    if typing.get_origin(typ) is list:
        return f"list[{typing.get_args(typ)[0].__name__}]"
    if typing.get_origin(typ) is typing.Literal:
        return "{" + ",".join(json.dumps(c) if c == "" else str(c) for c in typing.get_args(typ)) + "}"
    return typ.__name__


def metavar(typ: str) -> str:
    """How `--help` shows a key's type: INT, LIST[FLOAT]; a choice key's values as they are typed."""
    return typ if typ.startswith("{") else typ.upper()


def type_cell(typ: str) -> str:
    """A type in the configuration table: `int`; a choice key's values, each in code."""
    if typ.startswith("{"):
        return ", ".join(f"`{c}`" for c in typ[1:-1].split(","))
    return f"`{typ}`"


def show_default(value) -> str:
    """TOML spelling: strings quoted, booleans lower case, lists in brackets."""
    return json.dumps(value) if isinstance(value, (str, bool, list)) else repr(value)


def config_keys() -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """[(section, section summary, [(name, type, default, doc), ...]), ...] in the dataclasses' order."""
    sections = []
    for s in dataclasses.fields(JobConfig):
        cls = s.default_factory
        hints, defaults, docs = typing.get_type_hints(cls), cls(), key_docs(cls)
        keys = [
            (f.name, type_name(hints[f.name]), show_default(getattr(defaults, f.name)), key_doc(f.name, hints, docs))
            for f in dataclasses.fields(cls)
        ]
        sections.append((s.name, (cls.__doc__ or "").strip().splitlines()[0], keys))
    return sections


def key_doc(name: str, hints: dict, docs: dict[str, str]) -> str:
    """A key's doc; a list of tables (`[[data.sources]]`) adds each of its tables' keys with theirs."""
    doc = docs.get(name, "")
    typ = hints[name]
    if typing.get_origin(typ) is list and dataclasses.is_dataclass(item := typing.get_args(typ)[0]):
        doc += ". Each table: " + "; ".join(f"`{key}`: {text}" for key, text in key_docs(item).items())
    return doc


def help_text() -> str:
    """The config part of `train.py --help`: every key, `--section.key TYPE (default D)  doc`."""
    lines = [
        "config keys (--section.key VALUE or --section.key=VALUE; CLI > TOML > defaults; a bare boolean",
        "key is true; lists comma-separated, e.g. --optimizer.betas 0.9,0.95; dashes or underscores):",
    ]
    for section, _, keys in config_keys():
        lines.append(f"\n  [{section}]")
        for name, typ, default, doc in keys:
            lines.append(f"  --{section}.{name} {metavar(typ)} (default {default})")
            lines.append(f"      {doc}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The configuration table of docs/configuration.md."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for section, _, keys in config_keys():
        rows.append(f"| **[{section}]** | | | |")
        rows += [f"| `{name}` | {type_cell(typ)} | `{default}` | {doc} |" for name, typ, default, doc in keys]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table() if "--markdown" in sys.argv[1:] else help_text())
