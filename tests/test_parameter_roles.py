"""Parameter roles: the model says what each parameter is (ELRModel.parameter_roles); the optimizer's
groups, Muon's matrices, the float8 filter, the late switch and inference loading ask it. No module
outside elr/models matches parameter names to find a role: an AST scan holds that, and is run on
planted violations so it is known to fail when it should."""

import ast

import pytest
import torch
from trainer_utils import ROOT, model_args

from elr.config import Optimizer
from elr.models import build_model, flavors
from elr.models.model import PARAMETER_ROLES
from elr.train.optimizer import build_optimizer, muon_params

# Pieces of parameter names that code guessing a role would match on.
NAME_PIECES = (
    "conditioning",
    "step_size",
    "router",
    "output",
    "embed",
    "norm",
    "proj",
    "gate",
    "bias",
    "conv",
    "w1",
    "w2",
    "w3",
)
COMPARISONS = (ast.In, ast.NotIn, ast.Eq, ast.NotEq)
NAME_VARIABLES = {"name", "fqn", "key", "n", "k", "module_name", "param_name"}


def _pieces(node: ast.AST) -> list[str]:
    """The name pieces in a string literal or f-string operand."""
    parts = node.values if isinstance(node, ast.JoinedStr) else [node]
    return [
        p.value
        for p in parts
        if isinstance(p, ast.Constant) and isinstance(p.value, str) and any(piece in p.value for piece in NAME_PIECES)
    ]


def _name_like(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in NAME_VARIABLES) or isinstance(node, (ast.Call, ast.JoinedStr))


def name_matches(source: str) -> list[int]:
    """Lines that match a parameter name against a role-bearing piece: `".conditioning." in key`,
    `fqn != "output"`, `name.endswith("router")`, or reading a layer kind's `gates` names."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        compares = isinstance(node, ast.Compare) and any(isinstance(op, COMPARISONS) for op in node.ops)
        if compares:
            operands = [node.left, *node.comparators]
            pieces = [p for o in operands for p in _pieces(o)]
            if pieces and (any("." in p for p in pieces) or any(_name_like(o) for o in operands)):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("endswith", "startswith")
            and any(_pieces(a) for a in node.args)
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "gates":
            lines.append(node.lineno)
    return lines


def outside_the_model() -> dict[str, str]:
    files = [p for p in (ROOT / "elr").rglob("*.py") if p.relative_to(ROOT).parts[:2] != ("elr", "models")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_no_module_but_the_model_finds_roles_by_name():
    found = {path: lines for path, source in outside_the_model().items() if (lines := name_matches(source))}
    assert found == {}


@pytest.mark.parametrize(
    "line",
    [
        'ok = ".conditioning." in key',
        'ok = fqn != "output"',
        'ok = name.endswith("router")',
        'ok = ".step_size" not in f".{fqn}"',
        'ok = name.rsplit(".", 1)[-1] not in {g for kind in KINDS for g in kind.gates}',
        'ok = key.startswith("recurrent.conditioning")',
    ],
)
def test_the_scan_finds_planted_name_matches(line):
    assert name_matches(line) == [1]
    assert name_matches('ok = roles[name] == "conditioning" or role in ("matrix", "gate")') == []


def small(**options):
    args = model_args(
        flavors["debug"],
        max_seq_len=32,
        max_loops=3,
        update="adaptive_delta",
        conditioning=True,
        conditioning_exit=True,
        **options,
    )
    with torch.device("meta"):
        return build_model(args)


def test_every_parameter_has_a_known_role():
    model = small(identity_loops=True, loop_delta_rank=2)
    roles = model.parameter_roles()
    assert list(roles) == [name for name, _ in model.named_parameters()]
    assert set(roles.values()) == set(PARAMETER_ROLES)  # the debug flavor has every kind of parameter
    expected = {
        "tok_embeddings.weight": "embedding",
        "output.weight": "head",
        "norm.weight": "norm",
        "input_layers.0.sublayer.a_proj.weight": "gate",
        "input_layers.0.sublayer.q_proj.weight": "matrix",
        "input_layers.0.sublayer.q_conv.weight": "conv",
        "input_layers.0.sublayer.A_log": "vector",
        "recurrent.layers.1.sublayer.router.weight": "router",
        "recurrent.layers.1.sublayer.w1": "matrix",
        "recurrent.step_size.norm.weight": "step_size",
        "recurrent.step_size.proj.weight": "step_size",
        "recurrent.conditioning.heads.0.weight": "conditioning",
        "recurrent.conditioning.exit_heads.1.bias": "conditioning",
        "recurrent.loop_deltas.up": "loop_delta",
    }
    assert {name: roles[name] for name in expected} == expected


def test_the_optimizer_groups_and_muon_follow_the_roles():
    model = small().to_empty(device="cpu")
    roles = model.parameter_roles()
    ids = {id(p): name for name, p in model.named_parameters()}
    opt = build_optimizer(model, Optimizer(name="muon", weight_decay=0.1))
    by_role: dict[str, set] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            by_role.setdefault(roles[ids[id(p)]], set()).add((group["weight_decay"] > 0, group["muon"]))
    assert by_role == {
        "matrix": {(True, True)},
        "gate": {(True, False)},
        "router": {(True, False)},
        "head": {(True, False)},
        "conv": {(True, False)},
        "embedding": {(False, False)},
        "norm": {(False, False)},
        "vector": {(False, False)},
        "conditioning": {(False, False)},
        "step_size": {(False, False)},
    }
    assert {roles[ids[id(p)]] for p in muon_params(model)} == {"matrix"}
