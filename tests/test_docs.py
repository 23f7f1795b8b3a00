"""The README's configuration reference is the table made from the config dataclasses, which name
every key, and `train.py --help` lists every key with its type, default and doc."""

import contextlib
import dataclasses
import importlib.util
import io
import re

import pytest

from elr.config import JobConfig
from elr.config.reference import config_keys, key_docs, markdown_table
from trainer_utils import ROOT


def all_keys():
    return {f"{s.name}.{f.name}" for s in dataclasses.fields(JobConfig) for f in dataclasses.fields(s.default_factory())}


def test_readme_documents_every_config_key():
    readme = (ROOT / "README.md").read_text()
    reference = readme[readme.index("| key | default | meaning |"):]
    reference = reference[: reference.index("\n\n")]
    documented, section = set(), None
    for line in reference.splitlines():
        if m := re.match(r"\| \*\*\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"\| `(\w+)` \|", line):
            documented.add(f"{section}.{m.group(1)}")
    keys = all_keys()
    assert documented == keys, (sorted(keys - documented), sorted(documented - keys))


def test_every_key_has_its_doc_line_and_the_readme_holds_the_generated_table():
    for s in dataclasses.fields(JobConfig):
        docs = key_docs(s.default_factory)
        names = [f.name for f in dataclasses.fields(s.default_factory)]
        assert list(docs) == names, (s.name, names, list(docs))  # every field, in order, nothing else
        assert all(docs.values()), s.name
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "README table is stale: paste `python -m elr.config.reference --markdown`"


def test_help_lists_every_key_with_type_default_and_doc():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        train_script.main(["--help"])
    assert done.value.code == 0
    text = out.getvalue()
    listed = set(re.findall(r"^  --(\w+\.\w+) ", text, flags=re.M))
    assert listed == all_keys(), sorted(all_keys() ^ listed)
    for section, _, keys in config_keys():
        for name, typ, default, doc in keys:
            assert f"  --{section}.{name} {typ.upper()} (default {default})\n      {doc}\n" in text + "\n", name
    assert "--job.config_file" in text


def test_every_design_reference_points_to_a_section_of_docs_design():
    """The code cites the repository's own design note by section; each cited section exists."""
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    sections = set(re.findall(r"^#+ (\d+(?:\.\d+)?)\.? ", design, flags=re.M))
    files = [p for folder in ("elr", "kernels", "tests", "scripts") for p in (ROOT / folder).rglob("*.py")]
    cited = []
    for path in files:
        for m in re.finditer(r"([\w/.]*)DESIGN\.md( §(\d+(?:\.\d+)?))?", path.read_text()):
            if path.name == "test_docs.py":
                continue
            cited.append((path.name, m.group(1), m.group(3)))
    assert cited and all(prefix == "docs/" for _, prefix, _ in cited), cited
    assert all(section in sections for _, _, section in cited if section), (sections, cited)
