"""checkpoint.initial_load_path: a run (a later stage of training) starts from another run's weights, a
checkpoint or a Hugging Face export; its optimizer, schedule and data position start fresh."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from elr.checkpoint import dcp_note
from elr.errors import CheckpointError, ConfigError
from elr.interop import check_fits, differences, is_export, read_export
from elr.models import ModelArgs
from elr.train.checkpointer import CheckpointManager
from elr.train.train_state import ModelState

logger = logging.getLogger("elr")


def load_weights_from(
    path: str,
    model: nn.Module,
    model_args: ModelArgs,
    checkpointer: CheckpointManager,
    allow_missing: Callable[[str], bool],
    rank: int,
) -> None:
    """Load the weights of the checkpoint step folder or export at `path` into `model` (built from
    `model_args`, possibly sharded); `allow_missing`: the keys the source may lack (before the late switch)."""
    if is_export(path):
        return _from_export(path, model, model_args, allow_missing, rank)
    loaded = checkpointer.load_initial(path, {"model": ModelState(model)}, allow_missing=allow_missing)
    if loaded is None:
        raise ConfigError(f"checkpoint.initial_load_path: no committed checkpoint at {path}")
    if rank == 0:
        logger.warning(dcp_note(path))
    logger.info(f"started from the weights of {path} (step {loaded}); optimizer, schedule and data position fresh")


def _from_export(path: str, model: nn.Module, model_args: ModelArgs, allow_missing, rank: int) -> None:
    """A Hugging Face export's weights (safetensors: nothing unpickled), read by every rank and placed into
    this job's (possibly sharded) model; one line names what differs from its config."""
    args, _, state = read_export(path)
    diff = differences(args, model_args)
    if diff and rank == 0:
        logger.warning("checkpoint.initial_load_path: the export's model differs from this job's: " + "; ".join(diff))
    try:
        check_fits(model, state, path, allow_missing=allow_missing)
    except CheckpointError as e:
        raise CheckpointError(
            f"checkpoint.initial_load_path: {e}" + (f"; its config differs: {'; '.join(diff)}" if diff else "")
        ) from None
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    state = {k: v.to(dtypes[k]) for k, v in state.items()}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    logger.info(f"started from the weights of the export {path}; optimizer, schedule and data position fresh")
