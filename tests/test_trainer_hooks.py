"""The Trainer's extension points: a subclass (a training stage) overrides public hooks only.

Every Trainer subclass in elr/ overrides no underscored method of Trainer, and every method it adds is
called somewhere in elr/, scripts/ or train.py: a misspelt hook would be added, never called, and never
run. The rule is shown failing on a planted subclass. docs/extending.md's example stage is run as the
page prints it, on train_configs/debug.toml, and does what the page says.
"""

import ast
import functools
import importlib
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import DEBUG_TOML, ROOT, losses, overrides

from elr.config import load_config
from elr.rl.trainer import RLTrainer
from elr.train.trainer import Trainer

SOURCES = [*(ROOT / "elr").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), ROOT / "train.py"]


@functools.cache
def called_names() -> frozenset[str]:
    """Every attribute name the project's code reads (`self.rollout(...)`, `t.all_done()`, ...)."""
    names = set()
    for path in SOURCES:
        names |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
    return frozenset(names)


def trainer_subclasses() -> list[type]:
    """The classes in elr/ whose bases name a Trainer, imported."""
    found = []
    for path in (ROOT / "elr").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Trainer") for b in node.bases):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found.append(getattr(importlib.import_module(module), node.name))
    return found


def hook_problems(cls: type, called: set[str]) -> list[str]:
    """One line per method of `cls` that overrides an underscored method of Trainer, or that Trainer lacks
    and nothing calls."""
    problems = []
    for name, value in vars(cls).items():
        if not callable(value) or (name.startswith("__") and name.endswith("__")):
            continue
        if hasattr(Trainer, name):
            if name.startswith("_"):
                problems.append(f"{cls.__name__}.{name} overrides an underscored method of Trainer")
        elif name not in called:
            problems.append(f"{cls.__name__}.{name} is not a Trainer hook and nothing calls it")
    return problems


def test_trainer_subclasses_override_public_hooks_only():
    subclasses = trainer_subclasses()
    assert RLTrainer in subclasses and all(issubclass(c, Trainer) and c is not Trainer for c in subclasses)
    called = called_names()
    assert [line for cls in subclasses for line in hook_problems(cls, called)] == []


def test_the_rule_finds_a_private_override_and_a_misspelt_hook():
    class Planted(RLTrainer):
        def _build(self, mixed_depth):  # a private method of Trainer
            pass

        def build_dat(self):  # build_data, misspelt: never called
            pass

        def batches(self, step):  # a hook: fine
            return super().batches(step)

    assert hook_problems(Planted, called_names()) == [
        "Planted._build overrides an underscored method of Trainer",
        "Planted.build_dat is not a Trainer hook and nothing calls it",
    ]


def test_every_public_method_of_the_trainer_says_when_it_runs():
    public = [name for name, f in vars(Trainer).items() if inspect.isfunction(f) and not name.startswith("_")]
    assert "forward_backward_step" in public and "batches" in public
    assert [name for name in public if not (getattr(Trainer, name).__doc__ or "").strip()] == []


def docs_example() -> str:
    """The Python block of docs/extending.md's section "Adding a training stage", as printed."""
    page = (ROOT / "docs" / "extending.md").read_text()
    section = page.split("### Adding a training stage", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_stage_trains_on_the_second_halves_only(tmp_path):
    """The page's stage, on the debug config (32-token windows): step 1's logged loss is the cross entropy of
    each window's second half at its slot's k, computed here from the initial weights; it finishes 3 steps."""
    namespace = {}
    exec(compile(docs_example(), "docs/extending.md", "exec"), namespace)  # this repository's page, as printed
    stage = namespace["SecondHalfTrainer"]
    assert issubclass(stage, Trainer) and hook_problems(stage, called_names()) == []
    assert len(docs_example().splitlines()) <= 16  # a dozen lines and the imports

    dump = tmp_path / "run"
    trainer = stage(load_config(DEBUG_TOML, overrides(dump, 3)))
    try:
        ks = trainer.depths.loop_counts(1)[0].tolist()
        loader = iter(trainer.train_loader)
        batches = [next(loader) for _ in ks]
        trainer.train_loader.dataset.position = 0
        with torch.no_grad():
            whole, half, scored = 0.0, 0.0, 0
            for (x, y, _), k in zip(batches, ks):
                per_token = F.cross_entropy(trainer.model(x, loops=k).flatten(0, 1), y.flatten(), reduction="none")
                per_token = per_token.view(y.shape)
                whole += per_token.mean().item() / len(ks)
                half += per_token[:, y.shape[1] // 2 :].sum().item()
                scored += per_token[:, y.shape[1] // 2 :].numel()
        trainer.train()
    finally:
        trainer.close()
    logged = losses(dump)
    assert sorted(logged) == [1, 2, 3]
    assert logged[1] == pytest.approx(half / scored, rel=1e-6)
    assert logged[1] != pytest.approx(whole, rel=1e-3)  # the filter changed what was scored
