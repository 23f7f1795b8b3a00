"""What a training checkpoint holds of the model and the optimizer, as DCP Stateful objects.

The model by fully qualified name (DTensor shards under FSDP2/TP, plain tensors else); the optimizer
flattened to one entry per parameter and field, so a model that gained parameters (the late switch)
loads an older checkpoint with only the new parameters' entries missing. The CheckpointManager
(elr/train/checkpointer.py) saves and loads them with the trainer state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from elr.errors import CheckpointError


class ModelState(Stateful):
    """Model weights by fully qualified name: DTensor shards under FSDP2/TP, plain tensors else."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """Optimizer state flattened to one key per parameter and field.

    Flat keys (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`) make each parameter's optimizer
    state separate entries, so a model that gained parameters (the late switch) can load an older
    checkpoint with only the new parameters' entries missing.
    """

    _options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        never_stepped = [p for g in opt.param_groups for p in g["params"] if p not in opt.state]
        state_dict = get_optimizer_state_dict(self.model, opt, options=self._options)
        # get_optimizer_state_dict creates missing state with a zero-lr step, which leaves AdamW's
        # step count at 1. Zero it again (the dict holds the same tensors), so a parameter that was
        # never stepped is saved, and kept when a checkpoint lacks it, as fresh: step 0, no moments.
        for p in never_stepped:
            for value in opt.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A parameter the checkpoint lacked (allow_missing) still holds this optimizer's own group
        # hyperparameters, the others the saved ones (a scheduled lr), and torch takes a group's
        # values from its first parameter. One group, one value: the saved one.
        names = {p: _fqn(n) for n, p in self.model.named_parameters()}
        for group in self.optimizer.param_groups:
            for field, current in group.items():
                keys = [f"param_groups.{names[p]}.{field}" for p in group["params"]]
                keys = [k for k in keys if k in state_dict]
                saved = [state_dict[k] for k in keys if not _same(state_dict[k], current)]
                if field == "params" or not saved:
                    continue
                if not all(_same(v, saved[0]) for v in saved):
                    raise CheckpointError(f"optimizer: one param group here, mixed saved {field}")
                state_dict.update({k: saved[0] for k in keys})
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._options)


def _fqn(name: str) -> str:
    """A parameter name as state dicts write it: no compile or activation-checkpoint wrappers."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
