"""Validation batches: the first windows of a validation store, in order, the same at every evaluation, so
losses are comparable across steps and k; a chat folder's first conversations; a task's validation split.

A source of a mixture is validated on its own store: its `val_path`, else the val split of its prepared
folder; a Megatron or datatrove store holds one stream, so it needs a `val_path` to be validated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from elr.config.data import DataSource
from elr.data.loader import Batch, chat_batch, num_windows, windows_to_batch
from elr.data.sources import Source
from elr.data.stores import has_split, open_store, store_and_split
from elr.errors import DataError
from elr.text import tasks
from elr.text.chat_data import ChatSplit, is_chat_folder


def val_store(spec: DataSource) -> Source | None:
    """A source's validation store: `val_path` (a prepared folder's val split, or its train split when it has
    none; any other store as it is), else the val split of `path` when that is a prepared folder with one;
    None when the source has no validation data."""
    if spec.val_path:
        store, _ = store_and_split(spec.val_path)
        return open_store(store, "val" if has_split(store, "val") else "train", name=spec.name)
    store, _ = store_and_split(spec.path)
    if (Path(store) / "meta.json").is_file() and has_split(store, "val"):
        return open_store(store, "val", name=spec.name)
    return None


def window_batches(
    source: Source,
    seq_len: int,
    local_batch_size: int,
    num_batches: int,
    dp_rank: int,
    dp_world: int,
    document_masking: bool = False,
    vocab_size: int | None = None,
) -> Iterator[Batch]:
    """This rank's share of the first num_batches * dp_world * local_batch_size windows of `source`, in
    order. Checks now (not at the first evaluation) that they exist."""
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_world {dp_world}")
    available = num_windows(source.num_tokens, seq_len, source.where)
    global_batch = dp_world * local_batch_size
    if num_batches * global_batch > available:
        raise DataError(
            f"{source.where}: {num_batches} validation batches of {dp_world} x {local_batch_size} windows "
            f"need {num_batches * global_batch} windows of {seq_len + 1} tokens; the split has "
            f"{available}. "
            + (
                f"Lower validation.steps to {available // global_batch} or less"
                if available >= global_batch
                else "Not one batch fits: lower training.local_batch_size"
            )
            + " or add validation data (a larger --val-fraction in scripts/prepare_data.py)"
        )

    def batches() -> Iterator[Batch]:
        for b in range(num_batches):
            first = b * global_batch + dp_rank * local_batch_size
            picks = [(source, w) for w in range(first, first + local_batch_size)]
            yield windows_to_batch(picks, seq_len, document_masking, vocab_size)

    return batches()


def val_batches(
    path: str | Path,
    seq_len: int,
    local_batch_size: int,
    num_batches: int,
    dp_rank: int,
    dp_world: int,
    document_masking: bool = False,
) -> Iterator[Batch]:
    """The validation batches of one store: `folder/val.bin` or a folder's val split (window_batches), or a
    chat folder's first conversations, one per row, in order."""
    store, split = store_and_split(path)
    if is_chat_folder(store):
        return _val_chat_batches(store, seq_len, local_batch_size, num_batches, dp_rank, dp_world, document_masking)
    source = open_store(store, "val" if split == "train" else split)
    return window_batches(source, seq_len, local_batch_size, num_batches, dp_rank, dp_world, document_masking)


def _val_chat_batches(
    data_dir: Path,
    seq_len: int,
    local_batch_size: int,
    num_batches: int,
    dp_rank: int,
    dp_world: int,
    masking: bool,
) -> Iterator[Batch]:
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_world {dp_world}")
    split = ChatSplit(data_dir, "val")
    split.check_fits(seq_len)
    global_batch = dp_world * local_batch_size
    if num_batches * global_batch > split.num_conversations:
        raise DataError(
            f"{data_dir}: {num_batches} validation batches of {dp_world} x {local_batch_size} "
            f"conversations need {num_batches * global_batch}; the val split has "
            f"{split.num_conversations}. Lower validation.steps or add validation conversations."
        )

    def batches() -> Iterator[Batch]:
        for b in range(num_batches):
            first = b * global_batch + dp_rank * local_batch_size
            yield chat_batch(split, list(range(first, first + local_batch_size)), seq_len, masking)

    return batches()


def val_task_batches(
    task, seed: int, local_batch_size: int, num_batches: int, dp_rank: int, dp_world: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's share of the task's first num_batches * dp_world * local_batch_size validation
    examples: (inputs, labels, difficulties), the same each call."""
    global_batch = dp_world * local_batch_size
    for b in range(num_batches):
        rows, difficulties = tasks.batch(
            task, seed, tasks.VAL, b * global_batch + dp_rank * local_batch_size, local_batch_size
        )
        inputs, labels = tasks.inputs_and_labels(rows)
        yield torch.from_numpy(inputs.copy()), torch.from_numpy(labels), torch.from_numpy(difficulties)
