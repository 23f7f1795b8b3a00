"""Read a Hugging Face export back into this package: the model its config.json describes, with the
safetensors weights, for inference (`load_export`) or as a later run's starting point (`read_export`).

Only JSON and safetensors are read; a folder holding pickled weights (pytorch_model.bin, .pt) is refused
in one line without opening them. Every weight must fit the model (no key dropped or missing, the same
shapes) and be finite.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from elr.checkpoint.format import first_nonfinite, key_problems
from elr.config import config_from_dict
from elr.errors import CheckpointError
from elr.interop.hf_config import model_args, read_config
from elr.interop.hf_export import PREFIX, RANKS
from elr.interop.hf_weights import read_weights
from elr.models import ELRModel, ModelArgs, build_model


def read_export(folder: str | Path) -> tuple[ModelArgs, dict, dict[str, torch.Tensor]]:
    """(ModelArgs, config.json, weights under the ELR model's own names) of an export, checked."""
    folder = Path(folder)
    raw = read_config(folder)
    tensors = read_weights(folder)
    outside = sorted(k for k in tensors if not k.startswith(PREFIX))
    if outside:
        raise CheckpointError(f"{folder} holds weights outside the model: {', '.join(outside[:5])}")
    state = {k[len(PREFIX):]: v for k, v in tensors.items()}
    bad = first_nonfinite(state)
    if bad:
        raise CheckpointError(f"{folder} holds NaN/Inf in {bad}")
    return model_args(raw["elr_model"], folder / "config.json"), raw, state


def check_fits(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str | Path,
               allow_missing: Callable[[str], bool] = lambda key: False) -> None:
    """CheckpointError naming the keys unless `state` gives every weight of `model` (full shapes)."""
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # a DTensor's shape is its global one
    problems = key_problems(wanted, {k: tuple(v.shape) for k, v in state.items()}, [k for k in state if k not in wanted],
                            allow_missing, ("weights missing from the export", "export weights the model lacks",
                                            "shapes differ (export vs model)"))
    if problems:
        raise CheckpointError(f"{where} does not fit this model ({'; '.join(problems)})")


def load_export(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                max_seq_len: int | None = None) -> tuple[ELRModel, dict]:
    """Model (eval mode) and the training job's config, whose tokenizer path points at the export's
    ranks file. `max_seq_len` enlarges the RoPE table past the training length."""
    folder = Path(folder)
    args, raw, state = read_export(folder)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()  # fills the RoPE table; every parameter is then overwritten
    check_fits(model, state, folder)
    model.load_state_dict(state)
    if max_seq_len is not None:
        model.extend_positions(max_seq_len)
    return model.to(dtype).eval(), job_config(folder, raw)


def load_export_config(folder: str | Path) -> dict:
    """The training job's config of an export (as `load_export` returns it), without reading weights."""
    return job_config(Path(folder), read_config(folder))


def job_config(folder: Path, raw: dict) -> dict:
    """config.json's `elr_job`, validated (keys added since at their defaults), its tokenizer the export's."""
    cfg = config_from_dict(raw["elr_job"]).to_dict()
    if raw.get("elr_tokenizer") == RANKS:
        cfg["tokenizer"]["path"] = str((folder / RANKS).resolve())
    return cfg
