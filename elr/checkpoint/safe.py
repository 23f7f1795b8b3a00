"""Reading DCP checkpoints without running anything stored in them.

torch's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and DCP's default planner
loads every non-tensor item (optimizer hyperparameters, scheduler and trainer state) with
`torch.load(weights_only=False)`: a folder crafted by anyone who can write to it runs their code in
whoever loads it. Here the metadata unpickler admits only the classes DCP's own metadata is made of
(and the torch sizes, dtypes, layouts and paths inside it), and non-tensor items load through torch's
weights-only unpickler (plain containers, numbers, strings, tensors). DCP already loads tensors
weights-only. Every loader in this repository reads checkpoints through `read_metadata` and
`load_state_dict` below.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from elr.checkpoint.format import check_format, check_keys, first_nonfinite, verify
from elr.errors import CheckpointError, UnusableCheckpoint

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# (module, name) -> object, looked up before anything is imported: a name not listed is refused.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(_METADATA_MODULE, name): getattr(dcp_metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a table lookup by name
    # StorageMeta.checkpoint_id: the folder the save was written to (pathlib moved to pathlib._local in 3.13)
    **{(module, name): getattr(pathlib, name) for module in ("pathlib", "pathlib._local")
       for name in ("PosixPath", "PurePosixPath", "PureWindowsPath")},
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that can build DCP metadata and nothing else (the Python docs' "restricting
    globals"): every class or function a pickle names goes through `find_class`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        value = torch.__dict__.get(name) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout)):  # torch.float32 pickles as a global; not callable
            return value
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with `.metadata` read by the restricted unpickler and checked."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
                trailing = f.read(1)
        except FileNotFoundError:
            raise UnusableCheckpoint(path.parent, "has no .metadata") from None
        except Exception as e:  # whatever a damaged or hostile pickle raises, it is not loaded
            raise UnusableCheckpoint(path.parent, f"has an unreadable .metadata ({_first_line(e)})") from None
        if trailing:
            raise UnusableCheckpoint(path.parent, "has data after the pickle in .metadata")
        _check_metadata(metadata, path.parent)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_metadata(metadata: Any, folder: Path) -> None:
    """Refuse metadata of the right classes but the wrong shape (e.g. a path out of the folder)."""

    def refuse(what: str):
        raise UnusableCheckpoint(folder, f"has a malformed .metadata ({what})")

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        refuse("not DCP metadata")
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(value, (TensorStorageMetadata, BytesStorageMetadata)):
            refuse(f"entry {key!r}")
    if not isinstance(metadata.storage_data, dict):
        refuse("no storage table")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            refuse(f"storage entry {index!r}")
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") \
                or not (folder / name).is_file():
            refuse(f"{index.fqn} is stored in {name!r}, not a file of this folder")
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)) or info.transform_descriptors:
            refuse(f"storage entry of {index.fqn}")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor items read by torch's weights-only unpickler."""

    def __init__(self, folder: str | Path, allow_partial_load: bool = False):
        super().__init__(allow_partial_load=allow_partial_load)
        self.folder = Path(folder)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # a payload that needs more than plain values is refused, not run
            raise UnusableCheckpoint(self.folder, f"holds {fqn}, which is not a plain value ({_first_line(e)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def read_metadata(path: str | Path) -> Metadata:
    return SafeReader(path).read_metadata()


def load_state_dict(state_dict: dict[str, Any], path: str | Path, *, process_group=None,
                    allow_partial_load: bool = False) -> None:
    """`dcp.load` through the safe reader and planner (collective when a process group is given)."""
    dcp.load(state_dict, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path, allow_partial_load),
             process_group=process_group, no_dist=process_group is None)


def load_module(path: str | Path, module: torch.nn.Module, saved: dict, *, root: str = "",
                what: str = "this model") -> None:
    """Load a plain module (no process group) from a verified folder of a format this code reads,
    casting to the module's dtypes: the whole folder (an export: full tensors, plain names), or the
    entries under `root` (a training checkpoint's "model"). `saved` is the folder's DCP metadata.
    Strict both ways: a saved weight the module lacks means another network was built (`what` it was
    built from names it in the error); NaN/Inf are refused."""
    path = Path(path)
    state_dict = module.state_dict()
    request = {root: state_dict} if root else state_dict
    try:
        check_keys(request, saved, lambda key: False, only_requested_roots=bool(root))
    except CheckpointError as e:
        raise CheckpointError(f"{path} does not fit {what} ({e})") from None
    load_state_dict(request, path)
    bad = first_nonfinite(state_dict)
    if bad:
        raise UnusableCheckpoint(path, f"holds NaN/Inf in {bad}")
    module.load_state_dict(state_dict)


def load_model_export(path: str | Path, model: torch.nn.Module) -> None:
    """Load an `export_model` folder (full tensors, plain names) into a plain module, casting the dtype."""
    marker = verify(path)
    saved = read_metadata(path).state_dict_metadata
    check_format(Path(path), marker, saved)
    load_module(path, model, saved)


def dcp_note(path: str | Path) -> str:
    """The one line printed where a DCP checkpoint is handed to inference or to another run."""
    return (f"note: {path} is a DCP checkpoint, meant for your own runs: its .metadata is a pickle (read by a "
            "restricted unpickler that builds only DCP metadata); to share a model, export it as safetensors "
            "(scripts/export_hf.py)")


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().split("\n") or [""])[0]
    return f"{type(e).__name__}: {text[:157] + '...' if len(text) > 160 else text}"
