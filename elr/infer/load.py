"""Load a trained model from any checkpoint the trainer writes, on any device, without a process group.

Accepted: a DCP training checkpoint folder `.../checkpoint/step-N` (saved by any number of ranks,
before or after the late switch: a pre-switch checkpoint has no loop-conditioning parameters, so
the model is built without them), or a model-only export `.../checkpoint/step-N-model`. The model
config comes from the run's `config.json`, found in the first folder above the checkpoint holding one.
DCP reshards on load, so the world size the checkpoint was saved from does not matter.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from elr.config import config_from_dict
from elr.models import ELRModel, build_model
from elr.models.from_config import model_args_from_config
from elr.tokenizer import Tokenizer, build_tokenizer
from elr.train.checkpoint import check_format

# Loading without a process group is what we want; DCP warns that it assumed so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

TRAINING_PREFIX = "model."  # a training checkpoint stores the model under this top-level name


def find_run_config(checkpoint: Path) -> Path:
    for folder in checkpoint.resolve().parents:
        if (folder / "config.json").is_file():
            return folder / "config.json"
    raise FileNotFoundError(f"no config.json in any folder above {checkpoint}: is it a training checkpoint?")


def run_config(checkpoint: str | Path) -> dict:
    return json.loads(find_run_config(Path(checkpoint)).read_text())


def load_model(checkpoint: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               max_seq_len: int | None = None) -> tuple[ELRModel, dict]:
    """Model (eval mode) and run config. `max_seq_len` enlarges the RoPE table past the training
    length (positions beyond it were never trained)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a DCP checkpoint folder (no .metadata)")
    cfg = run_config(checkpoint)
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    check_format(checkpoint, saved)
    prefix = TRAINING_PREFIX if any(key.startswith(TRAINING_PREFIX) for key in saved) else ""
    embedding = saved.get(f"{prefix}tok_embeddings.weight")
    if embedding is None:
        raise ValueError(f"{checkpoint} holds no model weights (no {prefix}tok_embeddings.weight)")
    conditioning = any(key.startswith(prefix) and ".conditioning." in key for key in saved)
    # the trainer's own config -> ModelArgs step; a checkpoint without conditioning keys predates the switch
    args = model_args_from_config(config_from_dict(cfg), embedding.size[0], before_switch=not conditioning)
    if max_seq_len is not None:
        args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, max_seq_len))
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()  # fills the RoPE table; every parameter is then overwritten
    state_dict = model.state_dict()
    missing = [key for key in state_dict if prefix + key not in saved]
    if missing:
        raise ValueError(f"{checkpoint} does not fit the model of {find_run_config(checkpoint)}: "
                         f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    dcp.load({"model": state_dict} if prefix else state_dict, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(state_dict)
    return model.to(dtype).eval(), cfg


def load_tokenizer(cfg: dict, path: str | None = None) -> Tokenizer:
    """The run's tokenizer: `path` if given, else the config's path, relative to the working
    directory or else to this repository (where the bundled tokenizer lives)."""
    path = path or cfg["tokenizer"]["path"]
    in_repo = Path(__file__).resolve().parents[2] / path
    return build_tokenizer(str(in_repo) if not Path(path).is_file() and in_repo.is_file() else path)
