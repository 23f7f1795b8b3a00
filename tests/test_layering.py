"""docs/DESIGN.md §6: the layers and what each may import, read from the source of every module.

From the bottom: the kernels (elr_kernels); errors and the console; text (elr.text); the job config
(elr.config); the data stores and streams (elr.data) and the single-device models side by side; parallelism
and the checkpoint format side by side; the export format (elr.interop, which reads the checkpoint format);
training and inference side by side; tools, scripts, train.py, the server and the RLVR stage on top (the
server never imports training, and it and the RLVR stage never import each other). A module imports its own
layer or lower ones, never its side-by-side neighbour; the models never import torch.distributed, and only the
server's HTTP side imports the serve extra (fastapi, uvicorn). Beyond the layer numbers, no two folders
(elr.<package>, scripts, train.py, elr_kernels) import each other, directly or around a longer circle, but for
the one arrow declared in UPWARD. Imports inside functions count too. The checker is also run on planted
violations, so it is known to fail when it should.
"""

import ast
import functools

from trainer_utils import ROOT

LAYERS = {
    "elr_kernels": 0,
    "elr.errors": 1,
    "elr.console": 1,
    "elr.text": 2,
    "elr.config": 3,
    # token stores, mixtures, windows and document ids: what the trainer reads, never the model code
    "elr.data": 4,
    "elr.models": 4,
    "elr.parallel": 5,
    "elr.checkpoint": 5,
    # the Hugging Face export format: it reads and writes through the checkpoint format below it;
    # training writes exports, inference reads them
    "elr.interop": 6,
    "elr.train": 7,
    "elr.infer": 7,
    # the transformers classes of an export (and the remote code that imports them) wrap inference's
    # cache for transformers: on top
    "elr.tools": 8,
    "elr.cli": 8,
    "scripts": 8,
    "train": 8,
    "elr.interop.remote": 8,
    "elr.interop.hf_model": 8,
    # the server: inference and below, never training (its neighbour below, by NEIGHBOURS)
    "elr.serve": 8,
    # the RLVR stage: training and inference both (its rollouts decode through elr.infer); only train.py
    # and scripts import it, and it never imports the server
    "elr.rl": 8,
}
NEIGHBOURS = [
    ("elr.data", "elr.models"),  # the data never imports the model, nor the model the data
    ("elr.parallel", "elr.checkpoint"),
    ("elr.train", "elr.infer"),  # neither imports the other
    ("elr.serve", "elr.train"),
    ("elr.serve", "elr.rl"),
]
# the serve extra's packages: only the HTTP side of the server and its command import them
SERVE_EXTRA = ("fastapi", "starlette", "pydantic", "uvicorn", "openai")
SERVE_EXTRA_IMPORTERS = ("elr.serve.api", "elr.serve.protocol", "scripts.serve", "scripts.bench_serve")
NEVER = {"elr.models": ("torch.distributed",)}
# The one arrow between folders allowed to close a circle, and why. elr/infer/load.py reads exports through
# elr.interop, and the transformers classes of an export (elr/interop/hf_model.py, on top by LAYERS) wrap
# the inference cache. They stay in elr/interop because every export already written carries remote code
# (elr/interop/remote/) that imports them by that path: moving them would break those exports.
UPWARD = {("elr.interop", "elr.infer"): "elr.interop.hf_model wraps the inference cache; exports import it by name"}


def part(module: str) -> str | None:
    """The entry of LAYERS a dotted module name belongs to (its longest prefix), or None (third party)."""
    owners = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(owners, key=len, default=None)


@functools.cache
def imported(source: str) -> tuple[str, ...]:
    """Every module a source imports, `from a import b` read as a.b (b may be a module)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return tuple(names)


def folder(module: str) -> str:
    """The folder a dotted module name sits in: elr.<package or module> in the library, else its first name
    (scripts, train, elr_kernels)."""
    names = module.split(".")
    return ".".join(names[:2]) if names[0] == "elr" else names[0]


def folder_imports(sources: dict[str, str]) -> dict[tuple[str, str], str]:
    """(importing folder, imported folder) -> the first import seen that draws that arrow, as a line."""
    arrows = {}
    for module, source in sorted(sources.items()):
        if part(module) is None:
            continue
        for name in imported(source):
            if part(name) is not None and folder(name) != folder(module):
                arrows.setdefault((folder(module), folder(name)), f"{module} imports {name}")
    return arrows


def folder_circles(sources: dict[str, str]) -> list[str]:
    """One line per group of folders that import each other, two-way or around a longer circle, leaving out
    the arrows declared in UPWARD; each line names one import for every arrow inside the group."""
    arrows = {pair: line for pair, line in folder_imports(sources).items() if pair not in UPWARD}
    after: dict[str, set[str]] = {}
    for a, b in arrows:
        after.setdefault(a, set()).add(b)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for b in after.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    reach = {a: reachable(a) for a in after}
    groups = {frozenset(b for b in reach[a] if a in reach.get(b, ())) for a in after if a in reach[a]}
    return [
        f"folders {', '.join(sorted(group))} import each other: "
        + "; ".join(line for (a, b), line in sorted(arrows.items()) if a in group and b in group)
        for group in sorted(groups, key=sorted)
    ]


def violations(sources: dict[str, str]) -> list[str]:
    """{module name: source} -> one line per import the layer rule forbids, and one per circle of folders."""
    found = []
    for module, source in sources.items():
        mine = part(module)
        if mine is None:
            continue
        for name in imported(source):
            if any(name == f or name.startswith(f + ".") for f in NEVER.get(mine, ())):
                found.append(f"{module} imports {name}")
            if name.split(".")[0] in SERVE_EXTRA and module not in SERVE_EXTRA_IMPORTERS:
                found.append(f"{module} imports {name} (the serve extra)")
            theirs = part(name)
            if theirs is None or theirs == mine:
                continue
            if LAYERS[theirs] > LAYERS[mine] or (mine, theirs) in NEIGHBOURS or (theirs, mine) in NEIGHBOURS:
                found.append(f"{module} ({mine}) imports {name} ({theirs})")
    return found + folder_circles(sources)


def repository_sources() -> dict[str, str]:
    files = [
        *(ROOT / "elr").rglob("*.py"),
        *(ROOT / "kernels").rglob("*.py"),
        *(ROOT / "scripts").rglob("*.py"),
        ROOT / "train.py",
    ]
    sources = {}
    for path in files:
        base = (
            ROOT / "kernels" if path.is_relative_to(ROOT / "kernels") else ROOT
        )  # kernels/ is a folder, not a package
        parts = path.relative_to(base).with_suffix("").parts
        sources[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return sources


def test_every_module_imports_only_what_its_layer_may():
    sources = repository_sources()
    assert [m for m in sources if part(m) is None] == ["elr"], "every module but elr/__init__.py has a layer"
    assert {part(m) for m in sources} >= set(LAYERS), "every layer is populated"
    assert violations(sources) == []


def test_the_rule_finds_planted_violations():
    sources = repository_sources()
    planted = {
        "elr.models.attention": "import torch.distributed as dist",
        "elr.models.gdp": "from elr.parallel.context_parallel import conv_halos",
        "elr.infer.load": "def f():\n    from elr.train.trainer import Trainer",
        "elr.checkpoint.format": "from elr.parallel import parallelize",
        "elr.config.checks": "from elr.models import flavors",
        "elr.text.chat": "from elr.config import JobConfig",
        "elr.interop.hf_import": "from elr.infer.cache import InferenceCache",
        "elr_kernels.gated_delta_product.chunk": "import elr.errors",
        "elr.serve.scheduler": "from elr.train.trainer import Trainer",
        "elr.infer.generate": "import fastapi",
    }
    for module, line in planted.items():
        assert module in sources, module
        found = violations({**sources, module: sources[module] + "\n" + line + "\n"})
        # one line, and a second where the arrow the layers forbid also closes a circle of folders
        assert found and found[0].startswith(module), (module, found)
        assert all("import each other" in circle and f"{module} imports" in circle for circle in found[1:]), found
    # The checkpoint format importing the export format again (where the checkpoint manager used to sit): an
    # arrow up, and elr.checkpoint and elr.interop importing each other.
    module = "elr.checkpoint.storage"
    found = violations({**sources, module: sources[module] + "\ndef f():\n    from elr.interop import write_export\n"})
    assert len(found) == 2 and found[0].startswith(module), found
    assert found[1].startswith(
        "folders elr.checkpoint, elr.interop import each other: elr.checkpoint.storage imports elr.interop.write_export"
    ), found
    # Within one layer the numbers allow both arrows; the circle rule does not (scripts import elr.cli).
    module = "elr.cli"
    found = violations({**sources, module: sources[module] + "\ndef f():\n    import scripts.export_hf\n"})
    assert found == [
        "folders elr.cli, scripts import each other: elr.cli imports scripts.export_hf; "
        + folder_imports(sources)[("scripts", "elr.cli")]
    ], found


def test_the_rule_finds_a_longer_circle_of_folders():
    """Three folders of one layer, each importing the next: no two import each other, the circle is found."""
    sources = {"elr.tools.a": "import elr.cli", "elr.cli": "import scripts.b", "scripts.b": "from elr.tools import a"}
    assert violations(sources) == [
        "folders elr.cli, elr.tools, scripts import each other: elr.cli imports scripts.b; "
        "elr.tools.a imports elr.cli; scripts.b imports elr.tools.a"
    ]


def test_the_declared_upward_arrow_is_still_drawn():
    """An exception that no import needs any more is deleted, not kept as a licence."""
    arrows = folder_imports(repository_sources())
    for a, b in UPWARD:
        assert (a, b) in arrows and (b, a) in arrows, (a, b)
