"""The checkpoint format on disk, below training, inference and the export format (all three read it).

`format` says what a committed folder holds (commit.json with sizes and SHA-256 of every file, the job's
config.json) and checks it before anything in it is parsed; `storage` writes and reads the tensors
(safetensors) and the other items (JSON): no pickle anywhere; `ownership` decides what a save may remove
or set aside. The trainer's CheckpointManager (elr/train/checkpointer.py: async saves, pruning, the model
export at the end) writes folders through it; elr/infer/load.py and elr/interop read them. It imports
the models' layer kinds, the tokenizer's file hash and elr.errors; checkpoint code that needs anything
above (the export format, the trainer) lives above it.
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
