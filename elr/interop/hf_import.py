"""Read a Hugging Face export back into this package: the model its config.json describes, with the
safetensors weights, for inference (`load_export`) or as a later run's starting point (`read_export`).

Before anything is parsed, every file the export's manifest lists is checked against its SHA-256, and
only plain files of the folder itself are read (elr/interop/hf_hashes.py). Only JSON and safetensors are
read; a folder holding pickled weights (pytorch_model.bin, .pt) is refused in one line without opening
them. The weights' shapes (from the safetensors headers) are compared with the model built on the meta
device before anything is allocated; every weight must fit the model (no key dropped or missing) and
be finite. Error messages name files and keys, never quote their contents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import tiktoken
import torch

from elr.checkpoint.format import first_nonfinite, key_problems
from elr.config import config_from_dict
from elr.errors import CheckpointError
from elr.interop.hf_config import CONFIG, model_args, read_config
from elr.interop.hf_export import PREFIX, RANKS
from elr.interop.hf_hashes import plain_file, verify
from elr.interop.hf_tokenizer import TOKENIZER_JSON
from elr.interop.hf_weights import check_some_weights, read_weights, weight_shapes
from elr.models import ELRModel, ModelArgs, build_model

# Tables the model builds but an export does not store (the RoPE table, MoE counters): at most this many
# elements, so a config asking for max_seq_len = 2**40 is refused before anything is allocated.
MAX_UNSTORED_ELEMENTS = 1 << 28
MAX_DIMENSION = 1 << 31  # any one size in elr_model: larger products overflow even on the meta device


def open_export(folder: str | Path) -> tuple[ModelArgs, dict, set[str]]:
    """(ModelArgs, config.json, the manifest's names): every listed file checked before config.json is parsed."""
    folder = Path(folder)
    check_some_weights(folder)
    listed = verify(folder, [CONFIG])
    raw = read_config(folder)
    return model_args(raw["elr_model"], folder / CONFIG), raw, listed


def own_names(folder: Path, keys) -> list[str]:
    """The stored keys under the wrapper's prefix, without it; anything else is an error."""
    outside = sorted(k for k in keys if not k.startswith(PREFIX))
    if outside:
        raise CheckpointError(f"{folder} holds weights outside the model: {', '.join(outside[:5])}")
    return [k[len(PREFIX) :] for k in keys]


def check_export(folder: str | Path) -> tuple[ModelArgs, dict]:
    """Everything about an export short of reading its tensors: hashes, config, and the stored shapes
    (safetensors headers) against the model its config describes, built on the meta device."""
    folder = Path(folder)
    args, raw, listed = open_export(folder)
    shapes = weight_shapes(folder, listed)
    stored = dict(zip(own_names(folder, shapes), shapes.values()))
    check_fits(meta_model(args), stored, folder)
    return args, raw


def read_export(folder: str | Path, with_listed: bool = False) -> tuple:
    """(ModelArgs, config.json, weights under the ELR model's own names) of an export, checked; with
    `with_listed`, also the names its manifest lists."""
    folder = Path(folder)
    args, raw, listed = open_export(folder)
    own_names(folder, weight_shapes(folder, listed))  # before any tensor is read
    tensors = read_weights(folder, listed)
    state = dict(zip(own_names(folder, tensors), tensors.values()))
    bad = first_nonfinite(state)
    if bad:
        raise CheckpointError(f"{folder} holds NaN/Inf in {bad}")
    return (args, raw, state, listed) if with_listed else (args, raw, state)


def meta_model(args: ModelArgs) -> ELRModel:
    """The model `args` describe, on the meta device (nothing allocated), refused if the tables it would
    build beside its weights are absurd."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if isinstance(value, int) and value > MAX_DIMENSION:
            raise CheckpointError(
                f"{CONFIG}: elr_model.{field.name} = {value} is beyond any model this code builds "
                f"(at most {MAX_DIMENSION})"
            )
    with torch.device("meta"):
        model = build_model(args)
    stored = set(model.state_dict())
    unstored = sum(b.numel() for name, b in model.named_buffers() if name not in stored)
    if unstored > MAX_UNSTORED_ELEMENTS:
        raise CheckpointError(
            f"{CONFIG}: elr_model asks for {unstored} elements of tables the export does not "
            f"store (the RoPE table: max_seq_len = {args.max_seq_len}); more than "
            f"{MAX_UNSTORED_ELEMENTS}, refused"
        )
    return model


def check_fits(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor | tuple],
    where: str | Path,
    allow_missing: Callable[[str], bool] = lambda key: False,
) -> None:
    """CheckpointError naming the keys unless `state` (tensors, or shapes) gives every weight of `model`
    (full shapes; a model on the meta device will do)."""
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # a DTensor's shape is its global one
    given = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in state.items()}
    problems = key_problems(
        wanted,
        given,
        [k for k in state if k not in wanted],
        allow_missing,
        ("weights missing from the export", "export weights the model lacks", "shapes differ (export vs model)"),
    )
    if problems:
        raise CheckpointError(f"{where} does not fit this model ({'; '.join(problems)})")


def load_export(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_seq_len: int | None = None,
) -> tuple[ELRModel, dict]:
    """Model (eval mode) and the training job's config, whose tokenizer path points at the export's
    ranks file. `max_seq_len` enlarges the RoPE table past the training length."""
    folder = Path(folder)
    args, raw, state, listed = read_export(folder, with_listed=True)
    model = meta_model(args)
    check_fits(model, state, folder)  # before anything is allocated
    model.to_empty(device=device)
    model.init_weights()  # fills the RoPE table; every parameter is then overwritten
    model.load_state_dict(state)
    if max_seq_len is not None:
        model.extend_positions(max_seq_len)
    return model.to(dtype).eval(), job_config(folder, raw, listed)


def load_export_config(folder: str | Path) -> dict:
    """The training job's config of an export (as `load_export` returns it), without reading weights."""
    _, raw, listed = open_export(folder)
    return job_config(Path(folder), raw, listed)


def job_config(folder: Path, raw: dict, listed: set[str]) -> dict:
    """config.json's `elr_job`, validated (keys added since at their defaults), its tokenizer the export's:
    the ranks file in the folder when the manifest lists it, else (a folder re-saved by transformers,
    which writes no ranks file) the folder's tokenizer.json, which elr.infer.load.load_tokenizer turns
    back into the same ranks and checks against the hash the run recorded; or a tiktoken encoding name.
    Never a path the config names: an export reads nothing outside its folder."""
    cfg = config_from_dict(raw["elr_job"]).to_dict()
    source = raw.get("elr_tokenizer")
    if source == RANKS:
        cfg["tokenizer"]["path"] = str(plain_file(folder, RANKS if RANKS in listed else TOKENIZER_JSON).resolve())
    elif isinstance(source, str) and source in tiktoken.list_encoding_names():
        cfg["tokenizer"]["path"] = source
    else:
        raise CheckpointError(
            f"{folder / CONFIG}: elr_tokenizer must be {RANKS} (the ranks file in the folder) or a "
            "tiktoken encoding name"
        )
    return cfg
