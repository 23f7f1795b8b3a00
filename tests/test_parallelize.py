"""One parallelize() call applies float8 -> AC -> compile -> FSDP; ParallelDims owns the data-parallel
rank; a training step moves statistics to the host once, however many microbatches it has."""

import dataclasses
import sys

import pytest
import torch
from torchao.float8.float8_linear import Float8Linear
from trainer_utils import DEBUG_TOML, overrides

from elr.config import load_config
from elr.models import build_model, flavors
from elr.parallel.activation_checkpoint import CheckpointedLayer
from elr.parallel.parallel_dims import ParallelDims
from elr.parallel.parallelize import parallelize
from elr.train.step_report import LogWindow
from elr.train.trainer import Trainer


def test_parallelize_puts_float8_inside_the_checkpointed_layers():
    cfg = load_config(DEBUG_TOML, ["--float8.enable", "true", "--activation_checkpoint.mode", "full"])
    model = build_model(dataclasses.replace(flavors["debug"], max_seq_len=16))
    dims = ParallelDims(1, -1, 1)
    dims.build_mesh("cpu")
    assert dims.dp_mesh is None and dims.dp_rank == 0 and dims.dp_world == 1
    parallelize(model, dims, cfg, "cpu")
    layer = model.recurrent.layers[0]
    assert isinstance(layer, CheckpointedLayer)
    assert isinstance(layer._checkpoint_wrapped_module.sublayer.q_proj, Float8Linear)


def test_train_step_syncs_with_the_host_a_fixed_number_of_times(tmp_path, monkeypatch):
    """.item() and .tolist() calls per logged step (the step and its window's per-loop statistics) do
    not grow with the number of microbatches."""
    calls = []
    for name in ("item", "tolist", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, _original=original):
            if "/elr/" in sys._getframe(1).f_code.co_filename:  # the trainer's own, not torch's optimizer
                calls.append(sys._getframe(1).f_lineno)
            return _original(self)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def syncs(n_micro):
        batch = ["--training.local_batch_size", "1", "--training.global_batch_size", str(n_micro)]
        trainer = Trainer(load_config(DEBUG_TOML, overrides(tmp_path / str(n_micro), 1, *batch)))
        trainer.depths.switch_step = -1  # mixed depth from the first step, so loop statistics exist
        calls.clear()
        stats = trainer.train_step(1)
        window = LogWindow()  # the logging window's statistics, one transfer
        window.add(stats, 1.0, 1, 1.0)
        assert "loop1/update_norm" in window.loop_means() and stats.ks.shape == (1, n_micro)
        return len(calls) - 1  # less the CPU-side ks[dp_rank].tolist() that sets the loop counts

    assert syncs(1) == syncs(3)


@pytest.mark.slow  # two short training runs
def test_training_with_full_ac_equals_training_without(tmp_path):
    from trainer_utils import run

    plain = run(tmp_path / "plain", 2)
    checkpointed = run(tmp_path / "ac", 2, "--activation_checkpoint.mode", "full")
    assert checkpointed == plain  # same losses bit for bit, so the same updates
