"""docs/DESIGN.md §6: the layers and what each may import, read from the source of every module.

From the bottom: the kernels (elr_kernels); errors and the console; text and data (elr.text); the
job config (elr.config); the single-device models; parallelism, checkpoints and the export format side
by side; training and inference side by side; tools, scripts, train.py, the server and the RLVR stage on top (the
server never imports training, and it and the RLVR stage never import each other). A module imports its own layer or
lower ones, never its side-by-side neighbour; the models
never import torch.distributed, and only the server's HTTP side imports the serve extra (fastapi, uvicorn). Imports
inside functions count too. The checker
is also run on planted violations, so it is known to fail when it should.
"""

import ast

from trainer_utils import ROOT

LAYERS = {
    "elr_kernels": 0,
    "elr.errors": 1,
    "elr.console": 1,
    "elr.text": 2,
    "elr.config": 3,
    "elr.models": 4,
    # interop (the Hugging Face export format) sits beside checkpoint: training writes and reads it,
    # inference reads it, and it needs only the models below
    "elr.parallel": 5,
    "elr.checkpoint": 5,
    "elr.interop": 5,
    "elr.train": 6,
    "elr.infer": 6,
    # the transformers classes of an export (and the remote code that imports them) wrap inference's
    # cache for transformers: on top
    "elr.tools": 7,
    "elr.cli": 7,
    "scripts": 7,
    "train": 7,
    "elr.interop.remote": 7,
    "elr.interop.hf_model": 7,
    # the server: inference and below, never training (its neighbour below, by NEIGHBOURS)
    "elr.serve": 7,
    # the RLVR stage: training and inference both (its rollouts decode through elr.infer); only train.py
    # and scripts import it, and it never imports the server
    "elr.rl": 7,
}
NEIGHBOURS = [
    ("elr.parallel", "elr.checkpoint"),
    ("elr.train", "elr.infer"),  # neither imports the other
    ("elr.serve", "elr.train"),
    ("elr.serve", "elr.rl"),
]
# the serve extra's packages: only the HTTP side of the server and its command import them
SERVE_EXTRA = ("fastapi", "starlette", "pydantic", "uvicorn", "openai")
SERVE_EXTRA_IMPORTERS = ("elr.serve.api", "elr.serve.protocol", "scripts.serve", "scripts.bench_serve")
NEVER = {"elr.models": ("torch.distributed",)}


def part(module: str) -> str | None:
    """The entry of LAYERS a dotted module name belongs to (its longest prefix), or None (third party)."""
    owners = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(owners, key=len, default=None)


def imported(source: str) -> list[str]:
    """Every module a source imports, `from a import b` read as a.b (b may be a module)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def violations(sources: dict[str, str]) -> list[str]:
    """{module name: source} -> one line per import the layer rule forbids."""
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
    return found


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
        assert len(found) == 1 and found[0].startswith(module), (module, found)
