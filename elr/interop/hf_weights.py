"""Model weights as safetensors: one `model.safetensors`, or shards of at most `max_shard_bytes` with
`model.safetensors.index.json` (transformers' layout). A safetensors file is a JSON header and raw bytes:
reading one runs nothing, which is why exports hold no other weight format and nothing here reads one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from elr.errors import CheckpointError, UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")  # never read
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def _safetensors(what: str = "reading or writing a Hugging Face export"):
    try:
        import safetensors.torch
    except ImportError:
        raise UserError(f"{what} needs safetensors: pip install -e \".[hf]\"") from None
    return safetensors.torch


def check_installed(what: str) -> None:
    """UserError naming `what` unless safetensors can be imported (checked before a run, not at its end)."""
    _safetensors(what)


def write_weights(state_dict: dict[str, torch.Tensor], folder: Path,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write `state_dict` (plain CPU tensors) into `folder`; returns the files written."""
    st = _safetensors()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if len(shards) == 1:
        st.save_file(shards[0], str(folder / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards):
        st.save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [*names, INDEX]


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of an export (from the index when sharded), each a plain file of the folder."""
    if (folder / SINGLE).is_file():
        return [SINGLE]
    if not (folder / INDEX).is_file():
        pickled = [name for name in PICKLED if (folder / name).exists()]
        extra = f" ({', '.join(pickled)} is pickled and is never loaded)" if pickled else ""
        raise CheckpointError(f"{folder} holds no {SINGLE} or {INDEX}{extra}")
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{folder / INDEX}: not a safetensors index ({type(e).__name__}: {e})") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors") \
                or not (folder / name).is_file():
            raise CheckpointError(f"{folder / INDEX} names {name!r}, not a .safetensors file of this folder")
    return names


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export's safetensors files (on CPU, as stored)."""
    st = _safetensors()
    tensors: dict[str, torch.Tensor] = {}
    for name in weight_files(folder):
        try:
            part = st.load_file(str(folder / name))
        except Exception as e:  # a cut or damaged file: safetensors says what it found
            raise CheckpointError(f"{folder / name}: not a readable safetensors file ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
        doubled = sorted(set(part) & set(tensors))
        if doubled:
            raise CheckpointError(f"{folder}: {doubled[0]} is stored in more than one file")
        tensors.update(part)
    return tensors
