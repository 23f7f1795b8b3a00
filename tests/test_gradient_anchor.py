"""Every parameter gets a gradient tensor after backward, at every k, for every recurrence option and
for each production config's options (elr/parallel/gradient_anchor.py). FSDP2 reduce-scatters the
gradients a unit's parameters have; a parameter one rank's k leaves unused would make the ranks reduce
different tensors (the 8-rank koi4b crash of 2026-12-04). tests/distributed/loop_mismatch.py runs the
same configs on 2 ranks at different k against one process."""

import pytest
import torch
import torch.nn.functional as F
from test_recurrence_options import NEEDS, OTHER_VALUE
from trainer_utils import ROOT, model_args

from elr.config import load_config
from elr.config.recurrence import names
from elr.models import build_model, flavors
from elr.models.from_config import model_args_from_config
from elr.parallel.gradient_anchor import anchor_parameters

BASE = flavors["debug"]  # every layer kind: G, A, F, E
PRODUCTION = sorted(p.name for p in (ROOT / "train_configs").glob("*.toml") if p.stem not in ("debug", "sft_debug"))


def _model(args, anchored: bool = True):
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    model.train()
    if anchored:
        anchor_parameters(model.recurrent)
    return model


def _grads(model, loops) -> dict[str, torch.Tensor | None]:
    x = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # initial_state_noise draws from the CPU generator: the same noise for both models
    loss = F.cross_entropy(model(x, loops=loops).flatten(0, 1).float(), x.flatten()) + model.moe_aux_loss()
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _check_every_k(args) -> None:
    model, plain = _model(args), _model(args, anchored=False)
    K = args.recurrence.max_loops
    for loops in [*range(1, K + 1), torch.tensor([1, K])]:  # the last: an override row beside a row at K
        got, want = _grads(model, loops), _grads(plain, loops)
        missing = [name for name, g in got.items() if g is None]
        assert not missing, f"k={loops}: no gradient for {missing}"
        for name, g in got.items():  # the anchor adds zeros: used parameters keep their exact gradient
            assert torch.equal(g, want[name] if want[name] is not None else torch.zeros_like(g)), (loops, name)


@pytest.mark.parametrize("option", sorted(OTHER_VALUE))
def test_every_option_gives_every_parameter_a_gradient_at_every_k(option):
    needs = {key: v for key, v in NEEDS.get(option, {}).items() if key in names()}  # the model's, not training's
    options = {"max_loops": 3, "conditioning_exit": True, **needs, option: OTHER_VALUE[option]}
    if option == "conditioning":
        options.pop("conditioning_exit")
    if option == "max_loops":
        options["max_loops"] = OTHER_VALUE["max_loops"]
    _check_every_k(model_args(BASE, **options))


@pytest.mark.parametrize("config", PRODUCTION)
def test_each_production_configs_options_give_every_parameter_a_gradient_at_every_k(config):
    cfg = load_config(str(ROOT / "train_configs" / config), ["--model.flavor", "debug"])
    _check_every_k(model_args_from_config(cfg, vocab_size=BASE.vocab_size))


def test_without_the_anchor_a_k1_rank_leaves_the_state_norm_without_a_gradient():
    """What the anchor is for: shows this test's check can fail."""
    grads = _grads(_model(model_args(BASE, max_loops=3, state_norm=True), anchored=False), 1)
    assert grads["recurrent.state_norm.weight"] is None
    assert grads["recurrent.layers.0.norm.weight"] is not None


def test_the_anchor_changes_nothing_in_evaluation_or_without_gradients():
    model = _model(model_args(BASE, max_loops=3, state_norm=True))
    x = torch.randint(0, BASE.vocab_size, (2, 8))
    with torch.no_grad():
        train_out = model(x, loops=2)
    model.eval()
    assert torch.equal(model(x, loops=2), train_out)


@pytest.mark.slow
def test_two_ranks_at_k1_and_K_match_one_process_for_each_production_config():
    """Default tier: the production configs' options (the debug model), rank 0 at k = 1 beside rank 1 at
    k = K, FSDP2 on gloo, two updates: gradients equal one process's (tests/distributed/loop_mismatch.py)."""
    import os
    import subprocess
    import sys

    configs = [c for c in PRODUCTION if not c.endswith("_baseline.toml")]  # baselines run one loop on every rank
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "distributed" / "loop_mismatch.py"),
            *configs,
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"loop_mismatch: all checks passed ({', '.join(configs)})" in result.stdout


def test_the_anchor_holds_when_the_block_returns_every_loops_state():
    """every_loop and loop_exits (elr.loss_every_loop, elr.loop_consistency) hand the output block a list of
    states: the anchor rides on the last, and a k = 1 forward still gives every block parameter a gradient."""
    args = model_args(BASE, max_loops=3, state_norm=True, identity_loops=True, loop_delta_rank=2)
    model = _model(args)
    x = torch.randint(0, BASE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for loops in (1, 2):
        model.zero_grad(set_to_none=True)
        exits = model(x, loops=loops, loop_exits=True)
        (F.cross_entropy(exits.flatten(0, 2).float(), x.repeat(loops, 1).flatten()) + model.moe_aux_loss()).backward()
        missing = [name for name, p in model.recurrent.named_parameters() if p.grad is None]
        assert not missing, (loops, missing)
