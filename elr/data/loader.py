"""Training batches: windows of one token store or of a weighted mixture, a task, or conversations.

A sample is a window of seq_len + 1 tokens of a source: window w covers tokens [w * seq_len,
w * seq_len + seq_len + 1), so consecutive windows share one token and inputs = window[:-1],
labels = window[1:]. A source of n tokens has W = (n - 1) // seq_len windows; its sample i reads window
perm_e(i mod W) of its epoch e = i // W (elr/data/order.py), so an exhausted source starts its next epoch
on its own. One store is a mixture of one source; several are mixed by elr/data/mixture.py.

Samples form one global stream g = 0, 1, 2, ...: data parallelism cuts it into global microbatches of
dp_world * local_batch_size samples, and rank r takes the r-th run of local_batch_size samples of each.
The loader state is therefore one integer, the number of global samples consumed, identical on every
rank; loading it with another dp_world (same global microbatch) continues the same stream without
repeating or skipping a sample. A generated task (elr/text/tasks.py) streams the same way, and so
does a folder of conversations (elr/text/chat_data.py, meta.json "format": "chat"): sample g is then
conversation perm_e(g mod N), one per row, padded, its labels scored on the assistant turns only.

Every batch is a `Batch(inputs, labels, document_ids)`; document_ids is None unless `data.document_masking`
asks for it (elr/data/documents.py). Also here, the job's data arithmetic: microbatches per update, the
task's row length, the job's sources. Validation batches are elr/data/validation.py's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from elr.config import JobConfig, Training
from elr.config.data import DataSource
from elr.data.documents import document_ids
from elr.data.mixture import Mixture
from elr.data.order import EpochOrder, source_seed
from elr.data.sources import Source
from elr.data.stores import open_store, store_and_split
from elr.errors import ConfigError, DataError
from elr.text import tasks
from elr.text.chat_data import ChatSplit, is_chat_folder

# torchdata 0.11 warns on every loader that it calls a deprecated torch API; nothing for us to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


class Batch(NamedTuple):
    """A microbatch: inputs and labels [B, T] int64; document_ids [B, T] int32 (data.document_masking) or None."""

    inputs: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None = None


def num_windows(num_tokens: int, seq_len: int, name: str | Path) -> int:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    count = (num_tokens - 1) // seq_len
    if count < 1:
        raise DataError(f"{name}: {num_tokens} tokens are too few for one window of {seq_len + 1} tokens")
    return count


def windows_to_batch(
    picks: list[tuple[Source, int]], seq_len: int, masking: bool, vocab_size: int | None = None
) -> Batch:
    """Stack the given (source, window) pairs into a Batch: int64 tokens, contiguous; the document ids of
    each row from its source's document starts when masking. Every id is checked against the vocabulary."""
    rows = np.empty((len(picks), seq_len + 1), dtype=np.int64)
    ids = np.empty((len(picks), seq_len), dtype=np.int32) if masking else None
    for r, (source, w) in enumerate(picks):
        first = w * seq_len
        rows[r] = source.tokens(first, first + seq_len + 1)
        if masking:
            ids[r] = document_ids(source.document_starts(first + 1, first + seq_len), first, seq_len)
    if vocab_size is not None and len(picks) and (largest := int(rows.max())) >= vocab_size:
        r = int(np.argmax(rows.max(axis=1) >= vocab_size))
        source, w = picks[r]
        raise DataError(
            f"{source.where}: window {w} holds token id {largest}, past the tokenizer's vocabulary of {vocab_size} "
            "(data tokenized with another vocabulary, or read with the wrong dtype)"
        )
    rows = torch.from_numpy(rows)
    return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), None if ids is None else torch.from_numpy(ids))


class GlobalStream(IterableDataset):
    """A stream of samples g = 0, 1, 2, ... cut into global microbatches of dp_world x
    local_batch_size; rank r takes the r-th run of local_batch_size samples of each. `position`
    (global samples consumed, equal on every rank) is the whole state, so it reshards."""

    def __init__(self, local_batch_size: int, dp_rank: int, dp_world: int):
        super().__init__()
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_world {dp_world}")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be positive, got {local_batch_size}")
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.global_batch_size = local_batch_size * dp_world
        self._position = 0

    @property
    def position(self) -> int:
        """Global samples consumed so far, summed over ranks; equal on every rank."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if value < 0 or value % self.global_batch_size:
            raise DataError(
                f"data position {value} is not a non-negative multiple of the global microbatch "
                f"dp_world * local_batch_size = {self.dp_world} * {self.local_batch_size}; "
                "resume with the same global batch"
            )
        self._position = value

    def samples(self, first: int) -> Batch:
        """This rank's microbatch: global samples first .. first + local_batch_size - 1."""
        raise NotImplementedError

    def progress(self) -> dict[str, float]:
        """Metrics of how far the stream has read (a mixture: each source's epochs); none here."""
        return {}

    def __iter__(self) -> Iterator[Batch]:
        while True:  # reads self.position each time, so a state loaded mid-iteration holds
            batch = self.samples(self.position + self.dp_rank * self.local_batch_size)
            self.position += self.global_batch_size
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class MixtureDataset(GlobalStream):
    """Endless stream of this rank's windows of one or more sources, weighted (elr/data/mixture.py): global
    sample g is sample i of source s, which reads window order[s](i). Yields Batches of [local_batch_size,
    seq_len]."""

    def __init__(
        self,
        sources: list[Source],
        weights: list[float],
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seeds: list[int],
        shuffle: bool = True,
        document_masking: bool = False,
        vocab_size: int | None = None,
    ):
        super().__init__(local_batch_size, dp_rank, dp_world)
        self.sources, self.seq_len, self.masking, self.vocab_size = sources, seq_len, document_masking, vocab_size
        self.weights = weights
        self.mixture = Mixture(weights)
        self.num_windows = [num_windows(s.num_tokens, seq_len, s.where) for s in sources]
        self.order = [EpochOrder(n, seed, shuffle) for n, seed in zip(self.num_windows, seeds)]

    def set_origin(self, start: int, consumed: list[int]) -> None:
        """Continue a changed mixture: from sample `start` on, each source after its `consumed` samples."""
        self.mixture = Mixture(self.weights, start, consumed)

    def locate(self, g: int) -> tuple[int, int]:
        """(source, window) global sample g reads."""
        source, i = self.mixture.locate(np.array([g]))
        return int(source[0]), self.order[int(source[0])](int(i[0]))

    def samples(self, first: int) -> Batch:
        sources, samples = self.mixture.locate(np.arange(first, first + self.local_batch_size, dtype=np.int64))
        picks = [(self.sources[s], self.order[s](i)) for s, i in zip(sources.tolist(), samples.tolist())]
        return windows_to_batch(picks, self.seq_len, self.masking, self.vocab_size)

    def progress(self) -> dict[str, float]:
        consumed = self.mixture.consumed_at(self.position)
        if len(self.sources) == 1:
            return {"data/epochs": int(consumed[0]) / self.num_windows[0]}
        return {f"data/epochs/{s.name}": int(c) / n for s, c, n in zip(self.sources, consumed, self.num_windows)}


class TaskDataset(GlobalStream):
    """Endless stream of a depth-bound task's training examples (elr/text/tasks.py), generated from
    (seed, sample index): nothing to read, and the same stream on any number of ranks.

    Curriculum: over the first `curriculum_steps` updates the hardest difficulty drawn grows from 1
    to the task's maximum in equal stages (0: every difficulty from the start); a sample's stage
    follows from its index, so the position stays the whole state.
    """

    def __init__(
        self,
        task,
        local_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        samples_per_update: int,
        curriculum_steps: int = 0,
    ):
        super().__init__(local_batch_size, dp_rank, dp_world)
        self.task, self.seed = task, seed
        self.samples_per_update, self.curriculum_steps = samples_per_update, curriculum_steps

    def hardest(self, g: int) -> int:
        """The hardest difficulty drawn for global sample g."""
        top = self.task.max_difficulty
        if not self.curriculum_steps:
            return top
        return min(top, 1 + (g // self.samples_per_update) * top // self.curriculum_steps)

    def samples(self, first: int) -> Batch:
        rows = np.stack(
            [
                tasks.draw(self.task, self.seed, tasks.TRAIN, g, self.hardest(g))[0]
                for g in range(first, first + self.local_batch_size)
            ]
        )
        inputs, labels = tasks.inputs_and_labels(rows)
        return Batch(torch.from_numpy(inputs.copy()), torch.from_numpy(labels.copy()))


class ChatDataset(GlobalStream):
    """Endless stream of this rank's conversation rows (elr/text/chat_data.py): sample g is conversation
    perm_e(g mod N) of epoch e, shuffled as token windows are; Batches of [local_batch_size, seq_len]. A row is
    one conversation (and its padding): its document ids, when asked for, are all 0."""

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        shuffle: bool = True,
        document_masking: bool = False,
    ):
        super().__init__(local_batch_size, dp_rank, dp_world)
        self.split = ChatSplit(data_dir, "train")
        self.split.check_fits(seq_len)
        self.seq_len, self.masking = seq_len, document_masking
        self.conversation = EpochOrder(self.split.num_conversations, seed, shuffle)  # sample g -> its conversation

    def samples(self, first: int) -> Batch:
        conversations = [self.conversation(g) for g in range(first, first + self.local_batch_size)]
        return chat_batch(self.split, conversations, self.seq_len, self.masking)


def chat_batch(split: ChatSplit, conversations: list[int], seq_len: int, masking: bool) -> Batch:
    inputs, labels = split.rows(conversations, seq_len)
    return Batch(inputs, labels, torch.zeros(inputs.shape, dtype=torch.int32) if masking else None)


def open_sources(specs: list[DataSource], document_masking: bool) -> list[Source]:
    """Each spec's training store, refusing one without document starts when masking asks for them."""
    for spec in specs:  # an older folder's file named directly, as the loaders took it
        if Path(spec.path).suffix == ".bin" and not Path(spec.path).exists():
            raise FileNotFoundError(f"token file {spec.path} does not exist (see scripts/prepare_data.py)")
    sources = [open_store(*store_and_split(s.path), name=s.name) for s in specs]
    for spec, source in zip(specs, sources):
        if document_masking and not source.has_documents:
            raise ConfigError(
                f"data.document_masking: {spec.path} records no document starts (a single-file folder from an "
                f"older prepare_data.py); record them with `python scripts/prepare_data.py --record-documents "
                f"{spec.path}`, or set data.document_masking = false"
            )
    return sources


def build_train_loader(
    path: str | Path,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    shuffle: bool = True,
    document_masking: bool = False,
    vocab_size: int | None = None,
) -> StatefulDataLoader:
    """The training loader of one store (a prepared folder, `folder/train.bin`, a Megatron prefix, a datatrove
    folder) or chat folder: one microbatch per step; its dataset is `loader.dataset`.

    Batches are already formed by the dataset (batch_size=None) and read in the main process
    (num_workers=0): a memmap slice is cheap, and the state stays the single `position`."""
    store, _ = store_and_split(path)
    if is_chat_folder(store):
        return StatefulDataLoader(
            ChatDataset(store, seq_len, local_batch_size, dp_rank, dp_world, seed, shuffle, document_masking),
            batch_size=None,
            num_workers=0,
        )
    spec = DataSource(name=Path(store).name or "data", path=str(path), weight=1.0)
    sources = open_sources([spec], document_masking)
    dataset = MixtureDataset(
        sources, [1.0], seq_len, local_batch_size, dp_rank, dp_world, [seed], shuffle, document_masking, vocab_size
    )
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0)


def build_mixture_loader(
    specs: list[DataSource],
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    shuffle: bool = True,
    document_masking: bool = False,
    vocab_size: int | None = None,
) -> StatefulDataLoader:
    """The training loader of a weighted mixture (`[[data.sources]]`): each source's windows in its own order
    (the job's seed mixed with its name), interleaved by the weights; shaped as build_train_loader's."""
    sources = open_sources(specs, document_masking)
    seeds = [source_seed(seed, s.name) for s in specs]
    dataset = MixtureDataset(
        sources,
        [s.weight for s in specs],
        seq_len,
        local_batch_size,
        dp_rank,
        dp_world,
        seeds,
        shuffle,
        document_masking,
        vocab_size,
    )
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0)


def build_task_loader(
    task,
    local_batch_size: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    samples_per_update: int,
    curriculum_steps: int = 0,
) -> StatefulDataLoader:
    """The training loader of a generated task, shaped as build_train_loader's."""
    dataset = TaskDataset(task, local_batch_size, dp_rank, dp_world, seed, samples_per_update, curriculum_steps)
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0)


def microbatches(t: Training, dp_world: int) -> tuple[int, int]:
    """(global batch in sequences, microbatches per data-parallel rank) of one optimizer update."""
    per_update = t.local_batch_size * dp_world
    global_batch = per_update if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_update:
        raise ConfigError(
            f"training.global_batch_size: {global_batch} is not a multiple of local_batch_size x "
            f"data-parallel ranks = {t.local_batch_size} x {dp_world}"
        )
    return global_batch, global_batch // per_update


def job_task(cfg: JobConfig):
    """The job's depth-bound task (data.task), whose rows must be training.seq_len + 1 tokens."""
    d, seq_len = cfg.data, cfg.training.seq_len
    try:
        task = tasks.build_task(d.task, d.task_items, d.task_max_difficulty)
    except ValueError as e:
        raise ConfigError(f"data.task: {e}") from None
    if seq_len != task.row_len - 1:
        raise ConfigError(
            f"training.seq_len: {d.task} with {d.task_items} items takes inputs of "
            f"{task.row_len - 1} tokens; set training.seq_len = {task.row_len - 1} (got {seq_len})"
        )
    return task
