"""Shared helpers for the Hugging Face export tests: a small export of the debug flavor, resealing a
folder after an edit (as someone crafting one would), and loading the scripts."""

import importlib.util
import json
from pathlib import Path

import torch
from trainer_utils import DEBUG_TOML, ROOT

from elr.config import load_config
from elr.interop import write_export
from elr.interop.hf_hashes import MANIFEST, seal
from elr.models import build_model
from elr.models.from_config import model_args_from_config
from elr.text.tokenizer import build_tokenizer

TOKENIZER = ROOT / "data" / "tokenizer" / "elr8k.tiktoken"


def tiny_export(out: Path, **kwargs):
    """(model, tokenizer, folder): the debug flavor at K = 3, weights perturbed so the zero-initialised
    conditioning acts, exported to `out` (kv last_loop unless given)."""
    cfg = load_config(DEBUG_TOML, ["--training.seq_len", "64"])
    tokenizer = build_tokenizer(str(TOKENIZER))
    args = model_args_from_config(cfg, tokenizer.n_vocab)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.eval()
    write_export(model.state_dict(), args, cfg.to_dict(), tokenizer, out, **{"kv": "last_loop", **kwargs})
    return model, tokenizer, out


def reseal(folder: Path, add=(), drop=()) -> None:
    """Rewrite the hashes of the files the manifest lists (those still there, and `add`, less `drop`)."""
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    seal(folder, [n for n in [*listed, *add] if n not in drop and ((folder / n).exists() or (folder / n).is_symlink())])


def edit_config(folder: Path, change) -> None:
    """Apply `change` to config.json's dict, then reseal."""
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    reseal(folder)


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]
