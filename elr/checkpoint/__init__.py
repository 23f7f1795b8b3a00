"""Checkpoint folders, below both training and inference (both load models; neither imports the other).

`format` says what a committed folder holds (commit.json with sizes and SHA-256 of every file, the job's
config.json) and checks it before anything in it is parsed; `storage` writes and reads the tensors
(safetensors) and the other items (JSON): no pickle anywhere; `ownership` decides what a save may remove
or set aside. The trainer's CheckpointManager (`manager`: async saves, pruning, the model export at the
end) writes folders; elr/infer/load.py reads them. It imports the models' state, the export format
(elr.interop, beside it), config and elr.errors; training and inference import it, never the reverse.
"""

from elr.checkpoint.format import (
    CONFIG,
    CONVERT,
    FORMAT,
    MARKER,
    STEP_DIR,
    check_format,
    check_hashes,
    check_keys,
    check_sizes,
    committed_files,
    committed_steps,
    export_path,
    first_nonfinite,
    hash_files,
    latest_step,
    marker_or_reason,
    read_config,
    read_marker,
    step_folders,
    verify,
    write_marker,
)
from elr.checkpoint.storage import (
    SHARD,
    VALUES,
    Stored,
    dcp_note,
    load_model_export,
    load_module,
    save_plain,
    split_state,
    tensor_writer,
    write_failure,
    write_values,
)

__all__ = [
    "CONFIG",
    "CONVERT",
    "FORMAT",
    "MARKER",
    "SHARD",
    "STEP_DIR",
    "Stored",
    "VALUES",
    "check_format",
    "check_hashes",
    "check_keys",
    "check_sizes",
    "committed_files",
    "committed_steps",
    "dcp_note",
    "export_path",
    "first_nonfinite",
    "hash_files",
    "latest_step",
    "load_model_export",
    "load_module",
    "marker_or_reason",
    "read_config",
    "read_marker",
    "save_plain",
    "split_state",
    "step_folders",
    "tensor_writer",
    "verify",
    "write_failure",
    "write_marker",
    "write_values",
]
