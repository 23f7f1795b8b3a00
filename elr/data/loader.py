"""Training and validation batches from a memory-mapped token file.

A token file (`train.bin`, `val.bin`, written by scripts/prepare_data.py) is a flat stream of
token ids; `meta.json` beside it gives the dtype. A sample is a window of seq_len + 1 tokens:
window w covers tokens [w * seq_len, w * seq_len + seq_len + 1), so consecutive windows share one
token and inputs = window[:-1], labels = window[1:]. There are W = (n_tokens - 1) // seq_len.

Samples form one global stream g = 0, 1, 2, ...: sample g is window perm_e(g mod W) of epoch
e = g // W. Data parallelism cuts the stream into global microbatches of dp_world *
local_batch_size samples, and rank r takes the r-th run of local_batch_size samples of each.
The loader state is therefore one integer, the number of global samples consumed, identical on
every rank; loading it with another dp_world (same global microbatch) continues the same stream
without repeating or skipping a sample. A generated task (elr/text/tasks.py) streams the same way, and so
does a folder of conversations (elr/text/chat_data.py, meta.json "format": "chat"): sample g is then
conversation perm_e(g mod N), one per row, padded, its labels scored on the assistant turns only.

Also here, the job's data arithmetic: microbatches per update, the task's row length. Opening and
checking the token files (and their tokenizer) is elr/data/token_files.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from elr.config import JobConfig, Training
from elr.data.token_files import load_tokens
from elr.errors import ConfigError, DataError
from elr.text import tasks
from elr.text.chat_data import ChatSplit, is_chat_folder

# torchdata 0.11 warns on every loader that it calls a deprecated torch API; nothing for us to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs [local_bs, seq_len], labels [local_bs, seq_len]


_MASK64 = (1 << 64) - 1


def num_windows(tokens: np.ndarray, seq_len: int, path: str | Path) -> int:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    count = (len(tokens) - 1) // seq_len
    if count < 1:
        raise DataError(f"{path}: {len(tokens)} tokens are too few for one window of {seq_len + 1} tokens")
    return count


def windows_to_batch(tokens: np.ndarray, windows: list[int], seq_len: int) -> Batch:
    """Stack the given windows into (inputs, labels), int64 and contiguous."""
    rows = np.stack([tokens[w * seq_len : w * seq_len + seq_len + 1] for w in windows])
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap 64-bit hash; every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class WindowPermutation:
    """A pseudo-random bijection of range(n) in O(1) memory, so ~1e9 windows need no table.

    A 4-round Feistel network permutes the 2h-bit integers (the smallest even width that holds
    n - 1), and cycle walking re-applies it until the result is below n. That stays a bijection
    of range(n), and as 2^(2h) < 4n it takes fewer than four applications on average.
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        self.n, self.epoch = n, epoch
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.half_mask = (1 << self.half_bits) - 1
        base = _mix64(_mix64(seed & _MASK64) ^ epoch)
        self.keys = [_mix64(base ^ r) for r in range(self.ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half_bits, x & self.half_mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.half_mask)
        return (left << self.half_bits) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside range({self.n})")
        x = self._feistel(i)
        while x >= self.n:
            x = self._feistel(x)
        return x


class EpochOrder:
    """Which item global sample g reads: item g mod n of epoch g // n, in a fresh WindowPermutation
    per epoch when shuffling (the one the token windows and the conversations both use)."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perm = WindowPermutation(n, seed, epoch=0)  # of the current epoch

    def __call__(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        if not self.shuffle:
            return i
        if self._perm.epoch != epoch:
            self._perm = WindowPermutation(self.n, self.seed, epoch)
        return self._perm(i)


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

    def __iter__(self) -> Iterator[Batch]:
        while True:  # reads self.position each time, so a state loaded mid-iteration holds
            batch = self.samples(self.position + self.dp_rank * self.local_batch_size)
            self.position += self.global_batch_size
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class TokenWindowDataset(GlobalStream):
    """Endless stream of this rank's windows of a token file. Yields (inputs, labels), each
    [local_batch_size, seq_len] int64."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        shuffle: bool = True,
    ):
        super().__init__(local_batch_size, dp_rank, dp_world)
        self.path = Path(path)
        self.tokens = load_tokens(path)
        self.seq_len = seq_len
        self.num_windows = num_windows(self.tokens, seq_len, path)
        self.window = EpochOrder(self.num_windows, seed, shuffle)  # global sample g -> the window it reads

    def samples(self, first: int) -> Batch:
        windows = [self.window(g) for g in range(first, first + self.local_batch_size)]
        return windows_to_batch(self.tokens, windows, self.seq_len)


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
        return tuple(torch.from_numpy(x.copy()) for x in tasks.inputs_and_labels(rows))


class ChatDataset(GlobalStream):
    """Endless stream of this rank's conversation rows (elr/text/chat_data.py): sample g is conversation
    perm_e(g mod N) of epoch e, shuffled as token windows are; (inputs, labels) [local_batch_size, seq_len]."""

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        shuffle: bool = True,
    ):
        super().__init__(local_batch_size, dp_rank, dp_world)
        self.split = ChatSplit(data_dir, "train")
        self.split.check_fits(seq_len)
        self.seq_len = seq_len
        self.conversation = EpochOrder(
            self.split.num_conversations, seed, shuffle
        )  # global sample g -> its conversation

    def samples(self, first: int) -> Batch:
        return self.split.rows(
            [self.conversation(g) for g in range(first, first + self.local_batch_size)], self.seq_len
        )


def build_train_loader(
    path: str,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    shuffle: bool = True,
) -> StatefulDataLoader:
    """The training loader: one microbatch per step; its dataset is `loader.dataset`.

    Batches are already formed by the dataset (batch_size=None) and read in the main process
    (num_workers=0): a memmap slice is cheap, and the state stays the single `position`. A chat
    folder's train.bin serves conversation rows (ChatDataset)."""
    if is_chat_folder(Path(path).parent):
        dataset = ChatDataset(Path(path).parent, seq_len, local_batch_size, dp_rank, dp_world, seed, shuffle)
    else:
        dataset = TokenWindowDataset(path, seq_len, local_batch_size, dp_rank, dp_world, seed, shuffle)
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


def val_batches(
    path: str,
    seq_len: int,
    local_batch_size: int,
    num_batches: int,
    dp_rank: int,
    dp_world: int,
) -> Iterator[Batch]:
    """This rank's share of the first num_batches * dp_world * local_batch_size windows of the
    validation file, in order: the same each call, so validation losses are comparable. A chat
    folder's: its first conversations, one per row, in order."""
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_world {dp_world}")
    if is_chat_folder(Path(path).parent):
        return _val_chat_batches(Path(path).parent, seq_len, local_batch_size, num_batches, dp_rank, dp_world)
    tokens = load_tokens(path)
    available = num_windows(tokens, seq_len, path)
    global_batch = dp_world * local_batch_size
    if num_batches * global_batch > available:
        raise DataError(
            f"{path}: {num_batches} validation batches of {dp_world} x {local_batch_size} windows "
            f"need {num_batches * global_batch} windows of {seq_len + 1} tokens; the file has "
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
            yield windows_to_batch(tokens, list(range(first, first + local_batch_size)), seq_len)

    return batches()


def _val_chat_batches(
    data_dir: Path, seq_len: int, local_batch_size: int, num_batches: int, dp_rank: int, dp_world: int
) -> Iterator[Batch]:
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
            yield split.rows(list(range(first, first + local_batch_size)), seq_len)

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
