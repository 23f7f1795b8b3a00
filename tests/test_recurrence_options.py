"""The recurrence's options (elr/config/recurrence.py): each `[elr]` key reaches the model under its own
name, is frozen on resume and is written into an export, with no list of them kept anywhere else."""

import dataclasses

import pytest

from elr.config import ELR, load_config
from elr.config.recurrence import RecurrenceOptions, names
from elr.errors import CheckpointError, ConfigError
from elr.interop import hf_config
from elr.models import flavors
from elr.models.from_config import check_model_config, model_args_from_config
from elr.train.resume import FROZEN, check_resume

# The [elr] keys that are not recurrence options: they steer training (the draws of k, the loss, the
# step's optimizer group, the late switch), or pick the backbone's split. A new key lands here only
# on purpose; one that changes the network belongs in RecurrenceOptions.
TRAINING_KEYS = {
    "enabled",
    "partition",
    "step_lr_scale",
    "step_weight_decay",
    "loop_gate_lr_scale",
    "loop_fade_steps",
    "loss_every_loop",
    "sampling",
    "emulated_ranks",
    "one_loop_override",
    "loop_weights",
    "loop_weights_start",
    "loop_schedule_steps",
    "switch_at",
    "stop_at_switch",
    "switch_conditioning",
    "switch_warmup_steps",
    "switch_heal_steps",
    "switch_heal_lr_scale",
    "k1_anchor",
    "k1_anchor_steps",
    "loop_consistency",
}

# Per option, a valid value other than its default (with the other options at their defaults).
OTHER_VALUE = {
    "max_loops": 2,
    "recurrent_input": "state_plus_input",
    "update": "residual",
    "step_input": "delta",
    "conditioning": False,
    "conditioning_budget": False,
    "conditioning_gate": False,
    "conditioning_first_loop": False,
    "conditioning_later_loops": False,
    "conditioning_silu": True,
    "conditioning_exit": True,
    "backprop_loops": 2,
    "state_norm": True,
    "depth_scaled_init": True,
    "initial_state_noise": 0.5,
    "identity_loops": True,
    "loop_gate": "scaled",
    "loop_gate_floor": 0.5,
    "loop_delta_rank": 2,
}
# Options whose test value needs another option set too (truncated backprop needs a re-injected input, the scaled
# gates the identity loops and their fade).
NEEDS = {
    "backprop_loops": {"recurrent_input": "state_plus_input"},
    "loop_gate": {"identity_loops": True, "loop_fade_steps": 4},
    "loop_gate_floor": {"identity_loops": True, "loop_fade_steps": 4, "loop_gate": "scaled"},
}


def _overrides(options: dict) -> list[str]:
    return [arg for key, value in options.items() for arg in (f"--elr.{key}", str(value).lower())]


def test_the_elr_section_is_the_options_and_the_training_keys():
    keys = [f.name for f in dataclasses.fields(ELR)]
    assert keys[: len(names())] == names()
    assert set(keys) - set(names()) == TRAINING_KEYS
    assert set(OTHER_VALUE) == set(names()), "every option has a test value below"


@pytest.mark.parametrize("name", names())
def test_every_option_reaches_the_model_by_its_own_name(name):
    default = getattr(RecurrenceOptions(), name)
    value = OTHER_VALUE[name]
    assert value != default
    needs = NEEDS.get(name, {})
    cfg = load_config(None, _overrides({**needs, name: value}))
    args = model_args_from_config(cfg, vocab_size=256)
    assert getattr(args.recurrence, name) == value
    options = {key: v for key, v in needs.items() if key in names()}  # not the training keys an option needs
    assert args.recurrence == dataclasses.replace(RecurrenceOptions(), **options, **{name: value})


def test_the_baseline_and_the_one_loop_phase():
    baseline = load_config(None, ["--elr.enabled", "false", "--elr.max_loops", "1", "--elr.conditioning", "false"])
    assert model_args_from_config(baseline, vocab_size=256).recurrence == RecurrenceOptions.baseline()
    one_loop = model_args_from_config(load_config(None), vocab_size=256, mixed_depth=False).recurrence
    assert one_loop == dataclasses.replace(RecurrenceOptions(), conditioning=False)


@pytest.mark.parametrize("name", names())
def test_every_option_is_frozen_on_resume(name):
    assert f"elr.{name}" in FROZEN
    needs = NEEDS.get(name, {})
    saved = load_config(None, _overrides(needs)).to_dict()
    job = load_config(None, _overrides({**needs, name: OTHER_VALUE[name]})).to_dict()
    with pytest.raises(ConfigError, match=rf"^elr.{name}: cannot change on resume"):
        check_resume(saved, job, step=5)


def test_the_export_writes_every_option_and_reads_it_back():
    cfg = load_config(None, ["--elr.conditioning_exit", "--elr.max_loops", "4", "--elr.step_input", "channel"])
    args = model_args_from_config(cfg, vocab_size=256)
    config = hf_config.hf_config(args, {}, loops=2, kv="per_loop", dtype="float32", eot_id=0, tokenizer="t")
    assert list(config["elr_model"]["recurrence"]) == names()
    assert config["max_loops"] == 4
    assert hf_config.model_args(config["elr_model"]) == args
    # an export written before an option existed lacks it and reads it at its default (the behaviour before it)
    for name in ("backprop_loops", "state_norm", "depth_scaled_init", "initial_state_noise"):
        del config["elr_model"]["recurrence"][name]
    assert hf_config.model_args(config["elr_model"]) == args
    config["elr_model"]["recurrence"]["loops_per_token"] = 2  # an option this code does not know is refused
    with pytest.raises(CheckpointError, match="loops_per_token"):
        hf_config.model_args(config["elr_model"])


def test_a_bad_option_names_its_key():
    for name, value in [
        ("max_loops", 0),
        ("max_loops", 1_000_000),
        ("initial_state_noise", float("inf")),
        ("initial_state_noise", float("nan")),
        ("update", "gated"),
        ("step_input", "both"),
        ("backprop_loops", 4),
        ("backprop_loops", -1),
        ("backprop_loops", 1),
        ("initial_state_noise", -0.1),
    ]:
        with pytest.raises(ConfigError, match=rf"^elr.{name}: "):
            dataclasses.replace(RecurrenceOptions(), **{name: value}).check()
    RecurrenceOptions(backprop_loops=1, recurrent_input="state_plus_input").check()  # re-injected: fine
    with pytest.raises(ConfigError, match=r"^elr.conditioning_exit: needs elr.conditioning = true"):
        RecurrenceOptions(conditioning=False, conditioning_exit=True).check()


def test_model_args_built_without_a_config_run_the_same_checks():
    """A model's shape guards itself with the config's own checks of what can be built, not a copy of their
    rules: ModelArgs built without a job config (a test, an export) refuse it with the config's line. A
    combination that builds but trains badly is the config's alone (tests/test_training_aids.py builds one)."""
    debug = flavors["debug"]
    for name, value in [("update", "gated"), ("recurrent_input", "input"), ("step_input", "both"), ("max_loops", 0)]:
        with pytest.raises(ConfigError, match=rf"^elr.{name}: "):
            dataclasses.replace(debug, recurrence=dataclasses.replace(RecurrenceOptions(), **{name: value}))
    with pytest.raises(ConfigError, match=r"^elr.partition: must add up to the 8 layers of the layer pattern"):
        dataclasses.replace(debug, partition=(2, 2, 2))
    debug.with_recurrence(max_loops=3, backprop_loops=1)  # builds: the state alone cuts the input block off
    with pytest.raises(ConfigError, match=r"^elr.backprop_loops: needs elr.recurrent_input"):
        load_config(None, ["--elr.backprop_loops", "1"])
    with pytest.raises(ConfigError, match=r"^elr.partition: must add up to the 8 layers of flavor debug"):
        check_model_config(load_config(None, ["--elr.partition", "2,2,2"]))
