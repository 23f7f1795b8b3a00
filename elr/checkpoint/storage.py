"""A step folder's contents, written and read with no pickle: tensors in safetensors, the rest in JSON.

    shard-{r:05}-model-00001-of-00001.safetensors   rank r's tensors (its DTensor shards), each
                                                   shard's place in the full tensor in the header
    values.json                                    every non-tensor item (train state, schedule,
                                                   optimizer hyperparameters) by its flat key

Tensors go through torch.distributed.checkpoint with its Hugging Face storage writer and reader,
so a folder saved by N ranks loads into M ranks, or into a plain module with no process group.
The reader here builds DCP's metadata from the safetensors headers of the files commit.json lists
(and from nothing else), and checks that each tensor's shards tile it exactly. Values are plain
JSON (numbers, strings, booleans, null, lists, objects); each must have the kind the loading job
expects. Nothing here unpickles, and nothing read from a folder can name code to run.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from elr.checkpoint.format import CONFIG, FORMAT, check_keys, first_line, first_nonfinite, read_json_object, verify
from elr.errors import CheckpointError, UnusableCheckpoint

VALUES = "values.json"
SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")  # the storage writer's names
_SHARDING_INFO = "DCP_SHARDING_INFO"  # the header entry giving each tensor's offsets in the full tensor
_KINDS = (
    (bool, "boolean"),
    ((int, float), "number"),
    (str, "string"),
    (type(None), "null"),
    ((list, tuple), "list"),
    (dict, "object"),
)


# ---- writing ----


def split_state(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, values) by flat key (`optimizer.state.w.exp_avg`): the two halves a folder stores."""
    flat, _ = flatten_state_dict(state_dict)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: _plain(v, k) for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return tensors, values


def _plain(value: Any, key: str) -> Any:
    """`value` as JSON can hold it (tuples as lists); anything else is a bug of the caller."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, key) for k, v in value.items()}
    raise TypeError(
        f"checkpoint: {key} is a {type(value).__name__}; a checkpoint holds tensors and plain "
        "values (numbers, strings, booleans, None, lists, string-keyed dicts)"
    )


def write_values(folder: Path, values: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / VALUES, "w") as f:
        json.dump(values, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def tensor_writer(folder: Path) -> HuggingFaceStorageWriter:
    """The DCP storage writer of a step folder: one safetensors file per rank, shard offsets in its header."""
    return HuggingFaceStorageWriter(str(folder), save_distributed=True)


def write_failure(error: BaseException) -> str | None:
    """Why a write failed for space or permission ("No space left on device"), from the OSError that is
    `error`, that DCP's CheckpointException wraps, or that safetensors reports as "(os error N)"; None
    for any other error (a bug, which keeps its traceback)."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    for failure in getattr(error, "failures", {}).values():  # DCP: {rank: (exception, traceback)}
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, OSError):
            return cause.strerror or str(cause)
    code = re.search(r"\(os error (\d+)\)", str(error))
    return os.strerror(int(code[1])) if code else None


def save_plain(state_dict: dict[str, Any], folder: Path) -> None:
    """Write a whole state dict from this process alone (no process group): an export, a conversion."""
    tensors, values = split_state(state_dict)
    write_values(folder, values)
    dcp.save(tensors, storage_writer=tensor_writer(folder), no_dist=True)


# ---- reading ----


class _Reader(HuggingFaceStorageReader):
    """DCP's safetensors reader over the shard files commit.json lists, with the headers checked."""

    def __init__(self, folder: Path, shards: list[str]):
        super().__init__(str(folder))
        self.folder, self.shards, self._metadata = folder, shards, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = _read_headers(self.folder, self.shards)
        metadata = Metadata(
            state_dict_metadata=self._metadata.state_dict_metadata,
            storage_data=self._metadata.storage_data,
            storage_meta=StorageMeta(),
        )
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _read_headers(folder: Path, shards: list[str]) -> Metadata:
    from safetensors import safe_open
    from safetensors.torch import _getdtype

    chunks: dict[str, list[tuple[list[int], list[int], torch.dtype]]] = {}
    storage = {}
    for name in shards:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                info = json.loads((f.metadata() or {}).get(_SHARDING_INFO, "null"))
                for key in f.keys():
                    piece = f.get_slice(key)
                    shape, dtype = list(piece.get_shape()), _getdtype(piece.get_dtype())
                    offsets = info.get(key, {}).get("saved_offsets") if isinstance(info, dict) else None
                    if not (
                        isinstance(offsets, list)
                        and len(offsets) == len(shape)
                        and all(type(o) is int and o >= 0 for o in offsets)
                    ):
                        raise ValueError(f"no valid offsets for {key}")
                    chunks.setdefault(key, []).append((offsets, shape, dtype))
                    storage[MetadataIndex(fqn=key, offset=torch.Size(offsets))] = _HFStorageInfo(
                        relative_path=str(folder / name), shape=torch.Size(shape), dtype=dtype
                    )
        except Exception as e:  # whatever a damaged header raises (SafetensorError, ValueError, ...)
            raise UnusableCheckpoint(folder, f"has an unreadable {name} ({first_line(e)})") from None
    entries = {}
    for key, pieces in chunks.items():
        ndim = {len(shape) for _, shape, _ in pieces}
        size = [max(o[d] + s[d] for o, s, _ in pieces) for d in range(min(ndim))]
        problem = "differ in rank" if len(ndim) > 1 else _tiling_problem(size, pieces)
        if problem:
            raise UnusableCheckpoint(folder, f"holds {key} in shards that {problem}")
        entries[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=pieces[0][2]),
            size=torch.Size(size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in pieces],
        )
    return Metadata(state_dict_metadata=entries, storage_data=storage)


def _tiling_problem(size: list[int], pieces: list) -> str | None:
    """Why the shards (offsets, shape, dtype) do not cover the full tensor exactly once, or None."""
    if len({dtype for _, _, dtype in pieces}) > 1:
        return "differ in dtype"
    if sum(math.prod(s) for _, s, _ in pieces) != math.prod(size):
        return "do not cover it exactly"
    for i, (a, sa, _) in enumerate(pieces):
        for b, sb, _ in pieces[i + 1 :]:
            if (
                all(a[d] < b[d] + sb[d] and b[d] < a[d] + sa[d] for d in range(len(size)))
                and math.prod(sa)
                and math.prod(sb)
            ):
                return "overlap"
    return None


class Stored:
    """A verified folder's contents, headers read: what it holds (`entries`) and `load` into a state dict."""

    def __init__(self, folder: str | Path, marker: dict):
        self.folder = Path(folder)
        names = sorted(marker["files"])
        odd = [n for n in names if not SHARD.fullmatch(n) and n not in (VALUES, CONFIG)]
        if odd:
            raise UnusableCheckpoint(
                self.folder,
                f"holds {odd[0]}, which no checkpoint of format {FORMAT} has "
                f"(safetensors shards, {VALUES} and {CONFIG} only)",
            )
        self.reader = _Reader(self.folder, [n for n in names if SHARD.fullmatch(n)])
        self.tensors = self.reader.read_metadata().state_dict_metadata
        self.values = _read_values(self.folder) if VALUES in names else {}
        both = sorted(set(self.tensors) & set(self.values))
        if both:
            raise UnusableCheckpoint(self.folder, f"holds {both[0]} both as a tensor and in {VALUES}")

    def entries(self) -> dict[str, tuple | None]:
        """{flat key: tensor shape, or None for a plain value}: what `check_keys` compares."""
        return {**{k: tuple(m.size) for k, m in self.tensors.items()}, **dict.fromkeys(self.values)}

    def load(self, state_dict: dict[str, Any], *, process_group=None, allow_partial_load: bool = False) -> None:
        """Fill `state_dict` in place (its tensors, DTensor shards included, then its plain values);
        collective when a process group is given. Keys are checked by the caller (`check_keys`)."""
        flat, mappings = flatten_state_dict(state_dict)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor) and k in self.tensors}
        values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor) and k in self.values}
        for key, current in values.items():  # checked before any tensor is touched
            if _kind(self.values[key]) != _kind(current):
                raise UnusableCheckpoint(
                    self.folder,
                    f"holds {key} as a JSON {_kind(self.values[key])}, where this job has a {_kind(current)}",
                )
        dcp.load(
            tensors,
            storage_reader=self.reader,
            planner=DefaultLoadPlanner(allow_partial_load=allow_partial_load),
            process_group=process_group,
            no_dist=process_group is None,
        )
        for key, current in values.items():
            saved = self.values[key]
            set_element(state_dict, mappings[key], tuple(saved) if isinstance(current, tuple) else saved)


def _read_values(folder: Path) -> dict[str, Any]:
    return read_json_object(folder, VALUES, "an object of values")


def _kind(value: Any) -> str:
    return next(name for types, name in _KINDS if isinstance(value, types))


def load_module(
    path: str | Path, module: torch.nn.Module, stored: Stored, *, root: str = "", what: str = "this model"
) -> None:
    """Load a plain module (no process group) from a verified folder, casting to the module's dtypes:
    the whole folder (an export: full tensors, plain names), or the entries under `root` (a training
    checkpoint's "model"). Strict both ways: a saved weight the module lacks means another network
    was built (`what` it was built from names it in the error); NaN/Inf are refused."""
    path = Path(path)
    state_dict = module.state_dict()
    request = {root: state_dict} if root else state_dict
    saved = stored.entries()
    if not root:
        saved = {k: v for k, v in saved.items() if v is not None}  # an export's values are not weights
    try:
        check_keys(request, saved, lambda key: False, only_requested_roots=bool(root))
    except CheckpointError as e:
        raise CheckpointError(f"{path} does not fit {what} ({e})") from None
    stored.load(request)
    bad = first_nonfinite(state_dict)
    if bad:
        raise UnusableCheckpoint(path, f"holds NaN/Inf in {bad}")
    module.load_state_dict(state_dict)


def load_model_export(path: str | Path, model: torch.nn.Module) -> None:
    """Load an `export_model` folder (full tensors, plain names) into a plain module, casting the dtype."""
    marker = verify(path)
    load_module(path, model, Stored(path, marker))


def dcp_note(path: str | Path) -> str:
    """The one line printed where a training checkpoint is handed to inference or to another run."""
    return (
        f"note: {path} is a DCP checkpoint, meant for your own runs (safetensors and JSON, sharded as it was "
        "trained); to share a model, export it (scripts/export_hf.py)"
    )
