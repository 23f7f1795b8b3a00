"""The user-error classes: a mistake in what the job asks for, not a bug in the code.

Every one derives from `UserError`: train.py and the scripts print its one-line message and exit 2.
Any other exception is a bug and keeps its traceback. They live here, below everything, so a module
that raises one imports this file and nothing else for it.
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """A mistake in what the job asks for (config, data, tokenizer, checkpoint), not a bug in the code:
    train.py prints its one-line message and exits 2. Every other exception keeps its traceback."""


class ConfigError(UserError):
    """A bad config key or value; the message names the key."""


class DataError(UserError, ValueError):
    """A token file or its meta.json cannot serve this job (wrong dtype or size, too few tokens)."""


class TokenizerError(UserError, ValueError):
    """A ranks file or encoding that cannot be this project's tokenizer."""


class CheckpointError(UserError):
    """A checkpoint cannot be used as asked: keys or shapes differ, or the requested step is bad."""


class UnusableCheckpoint(CheckpointError):
    """A folder whose own files rule out loading it (missing, damaged, modified, or written by a
    newer version): not the caller's mistake, so a resume may fall back to an older checkpoint."""

    def __init__(self, folder: str | Path, reason: str):
        super().__init__(f"checkpoint {folder} {reason}")
        self.reason = reason


class OldCheckpointFormat(CheckpointError):
    """A checkpoint in a format this version never reads (pickle-based DCP files): not skipped for an
    older one, since the older ones are as old; the message names the conversion command."""


class FolderInUse(UserError):
    """Another run holds the lock of a folder this run would write."""


class RunWriteFailed(UserError):
    """A file of the run (metrics.jsonl, TensorBoard's events, config.json, the export at the end) could not
    be written (no space, no permission): the run stopped after a checkpoint where it could save one, so the
    same command resumes (or writes the missing export) once it can write."""
