"""docs/DESIGN.md §6: the layers and what each may import, read from the source of every module.

From the bottom: kernels; the plain data (errors, config, tasks, tokenizer); the single-device models;
parallelism and the checkpoint format side by side; training and inference side by side; tools,
scripts and train.py on top. A module imports its own layer or lower ones, never its side-by-side
neighbour; the models never import torch.distributed. Imports inside functions count too. The checker
is also run on planted violations, so it is known to fail when it should.
"""

import ast
from pathlib import Path

from trainer_utils import ROOT

LAYERS = {
    "kernels": 0,
    "elr.errors": 1, "elr.config": 1, "elr.config_checks": 1, "elr.config_keys": 1, "elr.config_help": 1,
    "elr.recurrence_options": 1, "elr.tasks": 1, "elr.tokenizer": 1,
    "elr.progress": 1, "elr.chat": 1, "elr.chat_data": 1, "elr.chat_formats": 1, "elr.dump_folder": 1,
    "elr.quiet_logs": 1,
    "elr.models": 2,
    # interop (the Hugging Face export format) sits beside checkpoint: training writes and reads it,
    # inference reads it, and it needs only the models below
    "elr.parallel": 3, "elr.checkpoint": 3, "elr.interop": 3,
    "elr.train": 4, "elr.infer": 4,
    # the transformers classes of an export (and the remote code that imports them) wrap inference's
    # cache for transformers: on top
    "elr.tools": 5, "elr.cli": 5, "scripts": 5, "train": 5, "elr.interop.remote": 5, "elr.interop.hf_model": 5,
}
NEIGHBOURS = [("elr.parallel", "elr.checkpoint"), ("elr.train", "elr.infer")]  # neither imports the other
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
            theirs = part(name)
            if theirs is None or theirs == mine:
                continue
            if LAYERS[theirs] > LAYERS[mine] or (mine, theirs) in NEIGHBOURS or (theirs, mine) in NEIGHBOURS:
                found.append(f"{module} ({mine}) imports {name} ({theirs})")
    return found


def repository_sources() -> dict[str, str]:
    files = [*(ROOT / "elr").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"), *(ROOT / "scripts").glob("*.py"),
             ROOT / "train.py"]
    sources = {}
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
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
        "elr.infer.load": "def f():\n    from elr.train.checkpoint import CheckpointManager",
        "elr.checkpoint.format": "from elr.parallel import parallelize",
        "elr.config": "from elr.models import flavors",
        "elr.interop.hf_import": "from elr.infer.cache import InferenceCache",
        "kernels.gated_delta_product.chunk": "import elr.errors",
    }
    for module, line in planted.items():
        assert module in sources, module
        found = violations({**sources, module: sources[module] + "\n" + line + "\n"})
        assert len(found) == 1 and found[0].startswith(module), (module, found)
