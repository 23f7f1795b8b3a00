"""The docs: a short README that begins with the two commands and links every page; every relative link
resolves; every script a page runs exists and takes the flags it is shown with; the configuration page
is the table made from the config dataclasses, which name every key, and `train.py --help` lists every
key with its type, default and doc."""

import contextlib
import dataclasses
import importlib.util
import io
import re

import pytest
from trainer_utils import ROOT

from elr.config import JobConfig
from elr.config.reference import config_keys, key_docs, markdown_table, metavar


def all_keys():
    return {
        f"{s.name}.{f.name}" for s in dataclasses.fields(JobConfig) for f in dataclasses.fields(s.default_factory())
    }


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "study" / "README.md"]
HISTORY = ROOT / "docs" / "LOG.md"  # dated entries: each command as it ran then
CONFIGURATION = ROOT / "docs" / "configuration.md"


def test_the_readme_is_short_begins_with_the_two_commands_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 250, len(lines)
    top = "\n".join(lines[:30])
    setup = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev,hf]"'
    tests = 'ruff check . && ruff format --check . && python -m pytest -q -m "not slow" tests'
    assert f"{setup} && python train.py" in top and f"{setup} && {tests}" in top
    assert tests in " ".join((ROOT / ".ci" / "run").read_text().split())  # the same command, line breaks aside
    linked = set(re.findall(r"\]\(docs/([\w/.-]+\.md)", readme))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in PAGES[1:]}
    assert pages <= linked, sorted(pages - linked)


def anchors(page) -> set[str]:
    """The anchors GitHub gives a Markdown page's headings: lower case, punctuation dropped (an em dash
    between two spaces leaves two hyphens), spaces as hyphens; a repeated heading gets -1, -2, ..."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if fenced or not (m := re.match(r"#{1,6} +(.+?) *#*$", line)):
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def test_every_relative_link_of_the_docs_resolves():
    """Every relative link's file exists, and a link to a heading of a Markdown page (`LOG.md#2026-12-05--...`)
    names one the page has."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", path):
                continue
            linked = page.parent / path if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_command_a_page_shows_names_a_script_and_flags_it_has(monkeypatch):
    from test_cli import parser_of

    shown = {}
    for page in PAGES:
        if page == HISTORY:
            continue
        for script, rest in re.findall(r"python (train\.py|scripts/\w+\.py)((?: +[^\s`|#&;]+)*)", page.read_text()):
            shown.setdefault(script, set()).update(  # --section.key overrides are the config's, checked above
                flag for flag in re.findall(r"(?<![\w-])(--[a-z][\w.-]*)", rest) if "." not in flag
            )
    assert "train.py" in shown and "scripts/rehearse.py" in shown
    unknown = []
    for script, flags in sorted(shown.items()):
        path = ROOT / script
        assert path.is_file(), f"a page runs {script}, which does not exist"
        if script == "train.py":  # its --section.key flags are the config's (checked above)
            continue
        with monkeypatch.context() as m:
            options = {o for action in parser_of(path, m)._actions for o in action.option_strings}
        unknown += [f"{script} {flag}" for flag in sorted(flags - options)]
    assert not unknown, unknown


def test_the_configuration_page_documents_every_config_key():
    page = CONFIGURATION.read_text()
    reference = page[page.index("| key | type | default | meaning |") :]
    reference = reference.split("\n\n")[0]
    documented, section = set(), None
    for line in reference.splitlines():
        if m := re.match(r"\| \*\*\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"\| `(\w+)` \|", line):
            documented.add(f"{section}.{m.group(1)}")
    keys = all_keys()
    assert documented == keys, (sorted(keys - documented), sorted(documented - keys))


def test_every_key_has_its_doc_line_and_the_configuration_page_holds_the_generated_table():
    for s in dataclasses.fields(JobConfig):
        docs = key_docs(s.default_factory)
        names = [f.name for f in dataclasses.fields(s.default_factory)]
        assert list(docs) == names, (s.name, names, list(docs))  # every field, in order, nothing else
        assert all(docs.values()), s.name
    assert markdown_table() in CONFIGURATION.read_text(), (
        "docs/configuration.md's table is stale: paste `python -m elr.config.reference --markdown`"
    )


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
            assert f"  --{section}.{name} {metavar(typ)} (default {default})\n      {doc}\n" in text + "\n", name
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


def test_the_pages_name_the_transformers_versions_pyproject_installs():
    """docs/interop.md said transformers >= 5.18 and < 5.25 after pyproject's `hf` extra had moved to >= 5.25:
    every page (the dated log aside) that gives transformers a version bound gives pyproject's."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    (spec,) = [s for s in extra if s.startswith("transformers")]
    lower = re.fullmatch(r"transformers>=([\d.]+)", spec)[1]  # no upper bound: the newest release is taken
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if page.name == "LOG.md":
            continue
        text = " ".join(page.read_text().split())
        for bound in re.findall(r"transformers (>=|<|<=) ?(\d+\.\d+)", text):
            if bound != (">=", lower):
                wrong.append(f"{page.name}: transformers {' '.join(bound)}")
    assert not wrong, f"pyproject installs {spec}: {wrong}"
