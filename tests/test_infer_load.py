"""Loading trained checkpoints for inference: before and after the late switch, and the export."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from elr.infer.load import load_model
from trainer_utils import run

SWITCH = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
          "--elr.switch_at", "0.5", "--checkpoint.export_dtype", "float32"]


def saved_model_tensors(path, prefix: str, keys) -> dict[str, torch.Tensor]:
    """The model tensors as stored, read straight from the checkpoint."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(meta[prefix + k].size, dtype=meta[prefix + k].properties.dtype) for k in keys}
    dcp.load({"model": state} if prefix else state, checkpoint_id=path, no_dist=True)
    return state


def test_checkpoints_before_and_after_the_switch_and_the_export_load(tmp_path):
    dump = tmp_path / "run"
    run(dump, 2, *SWITCH)  # step-1: one-loop phase, saved at the switch; step-2: mixed depth
    folder = dump / "checkpoint"
    before, _ = load_model(folder / "step-1")
    after, cfg = load_model(folder / "step-2")
    export, _ = load_model(folder / "step-2-model")
    assert before.recurrent.conditioning is None and after.recurrent.conditioning is not None
    assert cfg["training"]["steps"] == 2
    for model, path, prefix in [(before, folder / "step-1", "model."), (after, folder / "step-2", "model.")]:
        want = saved_model_tensors(path, prefix, model.state_dict().keys())
        for key, value in model.state_dict().items():
            assert torch.equal(value, want[key]), key
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        for k in (1, 2, 3):
            torch.testing.assert_close(export(tokens, k), after(tokens, k), atol=0, rtol=0)
