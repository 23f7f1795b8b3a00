"""Write a model as a folder that stands alone and loads in transformers (`trust_remote_code=True`):

    out/  config.json                 model_type, auto_map, every ModelArgs field, loops and kv defaults, the job config
          generation_config.json
          model.safetensors           (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
          tokenizer.json, tokenizer_config.json, special_tokens_map.json   (AutoTokenizer; chat template if given)
          elr.tiktoken                the run's ranks file, for this package's own loaders
          configuration_elr.py, modeling_elr.py   remote code: wraps the installed `elr` package
          README.md                   how to load it

The folder is written beside `out` under a temporary name and renamed when complete: a failed export
leaves nothing half-written. Weights are stored under "model." (the wrapper's name for the ELR model).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from elr.chat import CHAT_TEMPLATE
from elr.errors import CheckpointError
from elr.interop.hf_config import CONFIG, hf_config
from elr.interop.hf_tokenizer import write_tokenizer
from elr.interop.hf_weights import DEFAULT_MAX_SHARD_BYTES, write_weights
from elr.models.args import ModelArgs
from elr.tokenizer import Tokenizer

PREFIX = "model."  # the transformers wrapper holds the ELR model as `self.model`
RANKS = "elr.tiktoken"
REMOTE = Path(__file__).resolve().parent / "remote"
REMOTE_FILES = ("configuration_elr.py", "modeling_elr.py")

MODEL_CARD = """# ELR model (exported by the ELR trainer)

A looped language model: the recurrent block runs `loops` times (default {loops}, trained up to {max_loops}).
The remote code wraps the `elr` package, which must be installed (`pip install -e ".[hf]"` in the ELR trainer).

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    ids = tokenizer("<|endoftext|>The king said", return_tensors="pt").input_ids
    logits = model(ids, loops=2).logits
    out = model.generate(ids, max_new_tokens=32, loops=2, kv="last_loop")
"""


def write_export(state_dict: dict[str, torch.Tensor], args: ModelArgs, job: dict, tokenizer: Tokenizer,
                 out: str | Path, *, dtype: torch.dtype = torch.float32, loops: int | None = None,
                 kv: str = "per_loop", chat_template: str | None = CHAT_TEMPLATE,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> Path:
    """Export the ELR model weights `state_dict` (plain names, full CPU tensors) built from `args`.
    `loops`: the default loop count (default: the model's max_loops). `chat_template`: the Jinja template
    written into tokenizer_config.json (default: the one SFT trains with, elr/chat.py; None: none). An existing `out` is an error unless `overwrite`."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists: remove it or export to another folder")
    if max_shard_bytes < 1:
        raise CheckpointError(f"the shard size limit must be positive, got {max_shard_bytes}")
    loops = args.recurrence.max_loops if loops is None else loops
    if tokenizer.n_vocab > args.vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer.source} has {tokenizer.n_vocab} ids, but the model embeds "
                              f"{args.vocab_size}: not the tokenizer it was trained with")
    ranks = Path(tokenizer.source)
    config = hf_config(args, job, loops=loops, kv=kv, dtype=str(dtype).removeprefix("torch."),
                       eot_id=tokenizer.eot_id, tokenizer=RANKS if ranks.is_file() else tokenizer.source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_weights({PREFIX + k: v.detach().to(dtype) for k, v in state_dict.items()}, tmp, max_shard_bytes)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        eot = tokenizer.eot_id
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot, "do_sample": False}, indent=2))
        write_tokenizer(tokenizer, tmp, chat_template, args.max_seq_len)
        if ranks.is_file():
            shutil.copyfile(ranks, tmp / RANKS)
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, tmp / name)
        (tmp / "README.md").write_text(MODEL_CARD.format(loops=loops, max_loops=args.recurrence.max_loops))
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
