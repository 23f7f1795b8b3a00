"""Load a trained model from any checkpoint the trainer writes, on any device, without a process group.

Accepted: a Hugging Face export (elr/interop: config.json and safetensors, nothing unpickled; the form
to share), a training checkpoint folder `.../checkpoint/step-N` (safetensors and JSON through DCP,
nothing unpickled either; saved by any number of ranks,
before or after the late switch: a pre-switch checkpoint has no loop-conditioning parameters, so
the model is built without them), or a model-only export `.../checkpoint/step-N-model`. DCP
reshards on load, so the world size the checkpoint was saved from does not matter. An export's files
are checked against the SHA-256 in its elr_sha256.json before any is parsed; one re-saved by
transformers' `save_pretrained` has no ranks file, and its tokenizer comes back from tokenizer.json.

What is loaded is what was saved: the folder must be committed (commit.json), hold only the files
it lists, and every file must match its size and SHA-256 before any of them is parsed; the model is
built from the config.json inside the step folder, never from the run's config.json above it, which
a later run in the same dump folder may have rewritten; every checkpoint weight must be used (no key
dropped) and be finite; the tokenizer must have the hash the run recorded. A checkpoint in a format
before 4 (pickle-based DCP files) is refused in one line naming the conversion command.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from elr.checkpoint import CONFIG, Stored, dcp_note, load_module, read_config, verify
from elr.config import config_from_dict
from elr.errors import CheckpointError, TokenizerError
from elr.interop import is_export, load_export, load_export_config
from elr.interop.hf_tokenizer import TOKENIZER_JSON, tokenizer_from_json
from elr.models import ELRModel, build_model
from elr.models.from_config import model_args_from_config
from elr.text.tokenizer import Tokenizer, build_tokenizer

# Loading without a process group is what we want; DCP warns that it assumed so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

logger = logging.getLogger("elr")

TRAINING_PREFIX = "model."  # a training checkpoint stores the model under this top-level name


def run_config(checkpoint: str | Path, marker: dict | None = None) -> dict:
    """The config the checkpoint was trained with: its own config.json, read once every file of the
    folder passed its hash check (`marker`: the verified marker, else the folder is verified here)."""
    checkpoint = Path(checkpoint)
    if is_export(checkpoint):
        return load_export_config(checkpoint)
    marker = marker if marker is not None else verify(checkpoint)
    raw = read_config(checkpoint, marker)
    if raw is None:
        raise CheckpointError(
            f"{checkpoint} holds no {CONFIG} (saved without the job's config): inference "
            "cannot tell which network to build"
        )
    return config_from_dict(raw).to_dict()  # validated, and keys added since it was written at their defaults


_NOTED: set[str] = set()  # the DCP note is printed once per checkpoint and process


def load_model(
    checkpoint: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_seq_len: int | None = None,
    note: bool = True,
) -> tuple[ELRModel, dict]:
    """Model (eval mode) and run config. `max_seq_len` enlarges the RoPE table past the training
    length (positions beyond it were never trained). Any problem with the checkpoint is a
    CheckpointError (a UserError) naming it. `note`: say once that a DCP checkpoint is for one's own
    runs (the export, which is the answer to that note, passes False)."""
    checkpoint = Path(checkpoint)
    if is_export(checkpoint):
        return load_export(checkpoint, device, dtype, max_seq_len)
    marker = verify(checkpoint)  # committed, its files only, sizes and SHA-256 of each, a format this code reads
    cfg = run_config(checkpoint, marker)
    stored = Stored(checkpoint, marker)
    saved = stored.entries()
    prefix = TRAINING_PREFIX if any(key.startswith(TRAINING_PREFIX) for key in saved) else ""
    embedding = saved.get(f"{prefix}tok_embeddings.weight")
    if embedding is None:
        raise CheckpointError(f"{checkpoint} holds no model weights (no {prefix}tok_embeddings.weight as a tensor)")
    # the trainer's own config -> ModelArgs step; a checkpoint without conditioning weights predates the switch
    job = config_from_dict(cfg)
    args = model_args_from_config(job, embedding[0])
    with torch.device("meta"):
        roles = build_model(args).parameter_roles()
    conditioning = [name for name, role in roles.items() if role == "conditioning"]
    if conditioning and not any(prefix + name in saved for name in conditioning):
        args = model_args_from_config(job, embedding[0], mixed_depth=False)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()  # fills the RoPE table; every parameter is then overwritten
    load_module(checkpoint, model, stored, root=prefix.rstrip("."), what="the model its config describes")
    if max_seq_len is not None:
        model.extend_positions(max_seq_len)
    if note and str(checkpoint.resolve()) not in _NOTED:  # once it loaded: one that fails says only why
        _NOTED.add(str(checkpoint.resolve()))
        logger.warning(dcp_note(checkpoint))
    return model.to(dtype).eval(), cfg


def load_tokenizer(cfg: dict, path: str | None = None) -> Tokenizer:
    """The run's tokenizer: `path` if given, else the config's path, relative to the working
    directory or else to this repository (where the bundled tokenizer lives). It must have the
    SHA-256 the run recorded (`tokenizer.sha256`), when the run recorded one."""
    path = path or cfg["tokenizer"]["path"]
    in_repo = Path(__file__).resolve().parents[2] / path
    if Path(path).name == TOKENIZER_JSON:  # an export re-saved by transformers: no ranks file, the same ranks
        tokenizer = tokenizer_from_json(path)
    else:
        tokenizer = build_tokenizer(str(in_repo) if not Path(path).is_file() and in_repo.is_file() else path)
    want = cfg["tokenizer"].get("sha256", "")
    if want and tokenizer.sha256 != want:
        raise TokenizerError(
            f"tokenizer {tokenizer.source} has SHA-256 {tokenizer.sha256}, but the checkpoint "
            f"was trained with {want} (tokenizer.sha256 in its config.json): another vocabulary"
        )
    return tokenizer
