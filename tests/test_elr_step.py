"""The learned ELR step (update = adaptive_delta): every form starts as the plain stack, learns, and
trains in its own optimizer group."""

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import model_args

from elr.config import ELR, Optimizer, load_config
from elr.config.keys import choices
from elr.config.recurrence import RecurrenceOptions
from elr.errors import ConfigError
from elr.models import build_model, flavors
from elr.models.from_config import check_model_config
from elr.train.optimizer import build_optimizer

BASELINE = flavors["debug"]
DEBUG = model_args(BASELINE, max_loops=3, update="adaptive_delta")
STEP_INPUTS = choices(RecurrenceOptions, "step_input")


def make(seed=0, **overrides):
    torch.manual_seed(seed)
    model = build_model(model_args(DEBUG, max_seq_len=64, **overrides))
    model.init_weights()
    return model


def tokens(B=2, T=24):
    return torch.randint(0, DEBUG.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("step_input", STEP_INPUTS)
def test_every_step_form_is_the_plain_stack_at_init_and_gets_gradients(step_input):
    elr = make(step_input=step_input)
    torch.manual_seed(7)
    baseline = build_model(model_args(BASELINE, max_seq_len=64))
    baseline.init_weights()
    keys = set(baseline.state_dict())
    baseline.load_state_dict({k: v for k, v in elr.state_dict().items() if k in keys})
    x = tokens()
    assert torch.equal(elr(x, loops=1), baseline(x, loops=1))
    F.cross_entropy(elr(x, loops=2).flatten(0, 1), x.flatten()).backward()
    grads = [p.grad for p in elr.recurrent.step_size.parameters() if p.ndim == 1 or step_input != "channel"]
    assert grads and all(g is not None for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_step_forms_differ_once_trained():
    """The same nudge to the step's parameters moves the three forms differently."""
    x = tokens()
    outs = []
    for step_input in STEP_INPUTS:
        model = make(step_input=step_input)
        with torch.no_grad():
            for p in model.recurrent.step_size.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        outs.append(model(x, loops=2))
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])


def test_step_has_its_own_lr_and_weight_decay_group():
    model = make()
    opt = build_optimizer(model, Optimizer(lr=1e-3, weight_decay=0.1), ELR(step_lr_scale=0.1, step_weight_decay=0.5))
    step_ids = {id(p) for p in model.recurrent.step_size.parameters()}
    (group,) = [g for g in opt.param_groups if {id(p) for p in g["params"]} & step_ids]
    assert {id(p) for p in group["params"]} == step_ids
    assert group["lr"] == pytest.approx(1e-4) and group["weight_decay"] == 0.5
    assert all(g["lr"] == 1e-3 for g in opt.param_groups if g is not group)


@pytest.mark.parametrize(
    "key, value", [("elr.step_input", "token"), ("elr.step_lr_scale", "0"), ("elr.step_weight_decay", "-1")]
)
def test_bad_step_settings_are_refused(key, value):
    with pytest.raises(ConfigError, match=key):
        check_model_config(load_config(None, [f"--{key}", value]))
