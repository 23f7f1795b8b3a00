"""Model weights as safetensors: one `model.safetensors`, or shards of at most `max_shard_bytes` with
`model.safetensors.index.json` (transformers' layout). A safetensors file is a JSON header and raw bytes:
reading one runs nothing, which is why exports hold no other weight format and nothing here reads one.
Only files listed in the export's manifest (elr/interop/hf_hashes.py) and lying in the folder itself are read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from elr.errors import CheckpointError, UserError
from elr.interop.hf_hashes import MANIFEST, plain_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # never read, by name or by suffix:
PICKLED_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".ckpt")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def _safetensors(what: str = "reading or writing a Hugging Face export"):
    try:
        import safetensors.torch
    except ImportError:
        raise UserError(f'{what} needs safetensors: pip install -e ".[hf]"') from None
    return safetensors.torch


def check_installed(what: str) -> None:
    """UserError naming `what` unless safetensors can be imported (checked before a run, not at its end)."""
    _safetensors(what)


def write_weights(
    state_dict: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
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
        _save(st, shards[0], folder / SINGLE)
        return [SINGLE]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards):
        _save(st, shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [*names, INDEX]


def _save(st, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with the file readable as the umask allows (0644 under the usual 022), as every
    other file of an export is: safetensors writes it 0600, which other users and services cannot read."""
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask sets it: put it straight back
    os.umask(mask)
    return mask


def weight_files(folder: Path, listed: set[str]) -> list[str]:
    """The safetensors files of an export (from the index when sharded): plain files of the folder
    (elr/interop/hf_hashes.py), each listed in its manifest (`listed`, already verified)."""
    single, index = folder / SINGLE, folder / INDEX
    check_some_weights(folder)
    if single.exists() or single.is_symlink():
        names = [SINGLE]
    else:
        _listed(plain_file(folder, INDEX), listed)
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__})") from None
    for name in names:
        if not isinstance(name, str) or not name.endswith(".safetensors"):
            raise CheckpointError(f"{index} names {name!r}, not a .safetensors file")
        _listed(plain_file(folder, name), listed)
    return names


def check_some_weights(folder: Path) -> None:
    """CheckpointError unless the folder holds model.safetensors or its index and no pickled weight file
    (by name only: nothing is read). A pickled file beside the safetensors is refused too: which of two
    weight sets a tool loads is then up to the tool, and the pickled one can run code."""
    pickled = sorted({p.name for p in folder.iterdir() if p.name in PICKLED or p.suffix in PICKLED_SUFFIXES})
    if not any((folder / name).exists() or (folder / name).is_symlink() for name in (SINGLE, INDEX)):
        extra = f" ({', '.join(pickled)} is pickled and is never loaded)" if pickled else ""
        raise CheckpointError(f"{folder} holds no {SINGLE} or {INDEX}{extra}")
    if pickled:
        raise CheckpointError(
            f"{folder} holds {', '.join(pickled)} beside its safetensors weights: pickled files "
            "are never opened, and an export holds one weight set; remove them to load it"
        )


def _listed(path: Path, listed: set[str]) -> None:
    if path.name not in listed:
        raise CheckpointError(f"{path} is not listed in the export's {MANIFEST}")


def _open_error(path: Path, e: Exception) -> CheckpointError:
    """A cut or damaged file: the error's class only (its text may quote the file)."""
    return CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__})")


def _read_each(folder: Path, listed: set[str], read) -> dict:
    """{key: read(file)[key]} over the export's weight files, each key in one file only."""
    merged: dict = {}
    for name in weight_files(folder, listed):
        try:
            part = read(str(folder / name))
        except Exception as e:
            raise _open_error(folder / name, e) from None
        doubled = sorted(set(part) & set(merged))
        if doubled:
            raise CheckpointError(f"{folder}: {doubled[0]} is stored in more than one file")
        merged.update(part)
    return merged


def weight_shapes(folder: Path, listed: set[str]) -> dict[str, tuple[int, ...]]:
    """Each stored tensor's shape, read from the safetensors headers alone (no tensor data)."""
    st = _safetensors()

    def shapes(path: str) -> dict[str, tuple[int, ...]]:
        with st.safe_open(path, framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}

    return _read_each(folder, listed, shapes)


def read_weights(folder: Path, listed: set[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the export's safetensors files (on CPU, as stored)."""
    return _read_each(folder, listed, _safetensors().load_file)
