"""checkpoint.initial_load_path: a new run starts from another run's weights, with everything else fresh."""

import pytest
import torch
from trainer_utils import DEBUG_TOML, overrides

from elr.config import load_config
from elr.errors import ConfigError
from elr.train.trainer import Trainer

CKPT = ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0"]


def trainer(dump, steps, *extra) -> Trainer:
    return Trainer(load_config(DEBUG_TOML, overrides(dump, steps, *extra)))


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


@pytest.mark.slow  # three short runs, five trainers built: 15 s of CPU, 33 s wall on 2 busy cores
def test_a_run_started_from_another_runs_checkpoint_has_its_weights_at_step_0(tmp_path):
    first = trainer(tmp_path / "first", 2, *CKPT)
    initial = weights(first)
    first.train()
    trained = weights(first)
    first.close()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained), "training should move the weights"

    source = tmp_path / "first" / "checkpoint"
    for i, path in enumerate((source, source / "step-2")):  # a checkpoint folder (its newest step), or one step
        # a folder each: a built trainer leaves a run there that another job may not overwrite
        second = trainer(tmp_path / f"second{i}", 3, *CKPT, "--checkpoint.initial_load_path", str(path))
        got = weights(second)
        assert got.keys() == trained.keys()
        for name, value in trained.items():
            assert torch.equal(got[name], value), name
        assert second.step == 0 and second.tokens_seen == 0 and second.train_loader.dataset.position == 0
        assert not second.optimizer.state, "the optimizer starts fresh"
        second.close()

    # Once the new run has checkpoints of its own, it resumes from them, not from the other run.
    third = trainer(tmp_path / "third", 1, *CKPT, "--checkpoint.initial_load_path", str(source))
    third.train()
    resumed_weights = weights(third)
    third.close()
    resumed = trainer(tmp_path / "third", 1, *CKPT, "--checkpoint.initial_load_path", str(source))
    assert resumed.step == 1
    assert all(torch.equal(resumed_weights[k], v) for k, v in weights(resumed).items())
    resumed.close()


def test_initial_load_path_without_a_checkpoint_is_one_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path: no committed checkpoint"):
        trainer(tmp_path / "run", 1, "--checkpoint.initial_load_path", str(tmp_path / "empty"))
