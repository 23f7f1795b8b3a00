"""Write a model as a folder that stands alone and loads in transformers:

    out/  config.json                 model_type, auto_map, every ModelArgs field, loops and kv defaults, the job config
          generation_config.json      eos/pad, and the default loop count and KV mode of generate
          model.safetensors           (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
          tokenizer.json, tokenizer_config.json, special_tokens_map.json   (AutoTokenizer; chat template if given)
          elr.tiktoken                the run's ranks file, for this package's own loaders
          configuration_elr.py, modeling_elr.py   remote code: imports elr/interop/hf_model.py's classes
          elr_sha256.json             size and SHA-256 of every file above (elr/interop/hf_hashes.py)
          README.md                   the model card: how to load it

The folder is written beside `out` as `out.tmp` and renamed when complete: a failed export leaves
nothing half-written (a write that fails for space or permission is one CheckpointError line). An `out.tmp` this code
did not make (it lacks the marker file an export writes
first) is refused and left as it is; so is an existing `out` (with `overwrite`, only an ELR export is
replaced). Weights are stored under "model." (the wrapper's name for the ELR model).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from elr.checkpoint.storage import write_failure
from elr.errors import CheckpointError
from elr.interop.hf_config import CONFIG, hf_config, is_export
from elr.interop.hf_hashes import seal
from elr.interop.hf_tokenizer import write_tokenizer
from elr.interop.hf_weights import DEFAULT_MAX_SHARD_BYTES, write_weights
from elr.models.args import ModelArgs
from elr.text.chat import CHAT_TEMPLATE
from elr.text.tokenizer import Tokenizer

logger = logging.getLogger("elr")

PREFIX = "model."  # the transformers wrapper holds the ELR model as `self.model`
RANKS = "elr.tiktoken"
REMOTE = Path(__file__).resolve().parent / "remote"
REMOTE_FILES = ("configuration_elr.py", "modeling_elr.py")
PARTIAL = ".elr-export-partial"  # written first into out.tmp: marks a folder this code may clear

MODEL_CARD = """---
library_name: transformers
pipeline_tag: text-generation
tags:
- elr
- looped-language-model
---

# ELR model (exported by the ELR trainer)

A looped language model: its recurrent block runs `loops` times per token (default {loops}, trained up
to {max_loops}); generate's default KV cache mode is `{kv}`. Both are in `generation_config.json`.

## Loading

The model runs the ELR trainer's own code: install it (`pip install -e ".[hf]"` in its repository) and
import its transformers classes, which registers them with the Auto classes; nothing from this folder
runs:

    import elr.interop.hf_model  # registers model_type "elr" with AutoConfig / AutoModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    model = AutoModelForCausalLM.from_pretrained(FOLDER)
    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    ids = tokenizer("The king said", return_tensors="pt").input_ids  # begins with <|endoftext|>
    out = model.generate(ids, max_new_tokens=32, loops=2, num_beams=2, repetition_penalty=1.2)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    print(generator("The king said", max_new_tokens=32, loops=3)[0]["generated_text"])

Without that import, `trust_remote_code=True` tells transformers to run this folder's
`configuration_elr.py` and `modeling_elr.py`: Python code from the folder, with your permissions. Here
they only import the same classes from the installed `elr` package; read them before you load a
folder from someone else.

Prompts begin with `<|endoftext|>`, as every training document did: the tokenizer adds it (turn it off
with `add_special_tokens=False`, e.g. for text that already holds it); the chat template writes it.
"""


def write_export(
    state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    job: dict,
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    loops: int | None = None,
    kv: str = "per_loop",
    chat_template: str | None = CHAT_TEMPLATE,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Export the ELR model weights `state_dict` (plain names, full CPU tensors) built from `args`.
    `loops`: the default loop count (default: the model's max_loops). `chat_template`: the Jinja template
    written into tokenizer_config.json (default: the one SFT trains with, elr/text/chat.py; None: none). An existing
    `out` is an error unless `overwrite`."""
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise CheckpointError(f"{out} already exists: remove it or export to another folder")
    if (out.exists() or out.is_symlink()) and (out.is_symlink() or not is_export(out)):
        raise CheckpointError(f"{out} exists and is not an ELR export: not replaced (nothing was deleted)")
    if max_shard_bytes < 1:
        raise CheckpointError(f"the shard size limit must be positive, got {max_shard_bytes}")
    loops = args.recurrence.max_loops if loops is None else loops
    if tokenizer.n_vocab > args.vocab_size:
        raise CheckpointError(
            f"tokenizer {tokenizer.source} has {tokenizer.n_vocab} ids, but the model embeds "
            f"{args.vocab_size}: not the tokenizer it was trained with"
        )
    ranks = Path(tokenizer.source)
    config = hf_config(
        args,
        job,
        loops=loops,
        kv=kv,
        dtype=str(dtype).removeprefix("torch."),
        eot_id=tokenizer.eot_id,
        tokenizer=RANKS if ranks.is_file() else tokenizer.source,
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = claim_tmp(out)
    except OSError as e:
        raise CheckpointError(f"export: could not write {out} ({e.strerror or e}); nothing was written") from None
    try:
        write_weights({PREFIX + k: v.detach().to(dtype) for k, v in state_dict.items()}, tmp, max_shard_bytes)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        eot = tokenizer.eot_id
        (tmp / "generation_config.json").write_text(
            json.dumps(
                {
                    "bos_token_id": eot,
                    "eos_token_id": eot,
                    "pad_token_id": eot,
                    "do_sample": False,
                    "loops": loops,
                    "kv": kv,
                },
                indent=2,
            )
        )
        write_tokenizer(tokenizer, tmp, chat_template, args.max_seq_len)
        if ranks.is_file():
            shutil.copyfile(ranks, tmp / RANKS)
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, tmp / name)
        (tmp / "README.md").write_text(MODEL_CARD.format(loops=loops, max_loops=args.recurrence.max_loops, kv=kv))
        seal(tmp, [p.name for p in tmp.iterdir() if p.name != PARTIAL])
        (tmp / PARTIAL).unlink()
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = write_failure(e) if isinstance(e, Exception) else None
        if why is None:
            raise
        raise CheckpointError(f"export: could not write {out} ({why}); the partial export was removed") from None
    return out


def claim_tmp(out: Path) -> Path:
    """`out.tmp`, new and marked as this code's. One left by an interrupted export (it holds the marker)
    is cleared first; anything else there is refused and left."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists() or tmp.is_symlink():
        if tmp.is_symlink() or not tmp.is_dir() or not (tmp / PARTIAL).is_file():
            raise CheckpointError(
                f"{tmp} exists and was not made by an ELR export: remove or rename it, or export "
                "to another folder (nothing was deleted)"
            )
        logger.warning(f"removing {tmp}, left by an interrupted export")
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
    except FileExistsError:
        raise CheckpointError(f"{tmp} appeared meanwhile: is another export to {out} running?") from None
    try:
        (tmp / PARTIAL).write_text("an ELR export being written; removed when it completes\n")
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp
