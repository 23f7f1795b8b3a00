"""Checkpoint folders, below both training and inference (both load models; neither imports the other).

`format` says what a committed folder holds (commit.json with sizes and SHA-256 of every file, the job's
config.json) and checks it; `safe` reads DCP files without running anything stored in them. The
trainer's CheckpointManager (elr/train/checkpoint.py) writes folders; elr/infer/load.py reads them.
"""

from elr.checkpoint.format import (
    CONFIG,
    FORMAT,
    MARKER,
    STEP_DIR,
    check_format,
    check_hashes,
    check_keys,
    check_sizes,
    committed_files,
    committed_steps,
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
from elr.checkpoint.safe import dcp_note, load_model_export, load_module, load_state_dict, read_metadata

__all__ = [
    "CONFIG", "FORMAT", "MARKER", "STEP_DIR", "check_format", "check_hashes", "check_keys", "check_sizes",
    "committed_files", "committed_steps", "dcp_note", "first_nonfinite", "hash_files", "latest_step", "load_model_export",
    "load_module", "load_state_dict", "marker_or_reason", "read_config", "read_marker", "read_metadata",
    "step_folders", "verify", "write_marker",
]
