"""A weighted mixture of sources as one stream: global sample g -> (source, sample within that source).

The weights become whole counts c_s over a block of B = sum(c_s) samples: the smallest B up to MAX_BLOCK
in which every normalised weight times B is a whole number (0.5 / 0.3 / 0.2: B = 10, counts 5 / 3 / 2),
else B = MAX_BLOCK with the counts by largest remainder (each share then within 1 / MAX_BLOCK of its
weight). Within a block each source's c_s samples are spread evenly (its k-th at (k + 1/2) B / c_s, ties
to the source listed first). The schedule repeats every B samples, so any B consecutive samples, aligned
or not, hold exactly c_s of source s, and so does every multiple of B (any 1,000 consecutive samples of
0.5 / 0.3 / 0.2 hold exactly 500 / 300 / 200).

Sample g (h = g - start) is sample consumed_s + (h // B) c_s + k of source s, where slot h mod B is that
source's k-th of the block. The loader's state stays the one integer g: (start, consumed) is the mixture's
origin, (0, nothing) for a run's first mixture; a resume that changes the sources or weights starts the new
mixture at its position with each source's count so far (`continue_mixture`), recorded in the run's resume
history, so each source continues where it stopped instead of skipping or repeating samples.

Why not torchdata's or numpy's samplers: a weighted random draw holds the proportions only in expectation
(docs/data.md); this schedule is exact in every block, and a function of g alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from elr.errors import ConfigError

MAX_BLOCK = 10_000
ORIGIN = "data_origin"  # a resume history entry's record of where a changed mixture starts


def block_counts(weights: Sequence[float]) -> np.ndarray:
    """Each source's whole count in one block (their sum is the block): exact where a block up to
    MAX_BLOCK makes every share whole, else by largest remainder over MAX_BLOCK."""
    p = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    sizes = np.arange(1, MAX_BLOCK + 1)
    scaled = np.outer(sizes, p)
    whole = np.round(scaled)
    exact = np.all(np.abs(scaled - whole) < 1e-6, axis=1) & (whole.sum(axis=1) == sizes)
    if exact.any():
        counts = whole[int(np.argmax(exact))].astype(np.int64)
    else:
        ideal = p * MAX_BLOCK
        counts = np.floor(ideal).astype(np.int64)
        extra = np.argsort(-(ideal - counts), kind="stable")[: MAX_BLOCK - int(counts.sum())]
        counts[extra] += 1
    if (counts == 0).any():
        raise ConfigError(f"data.sources: a weight below 1/{MAX_BLOCK} of the total rounds to no samples ({p})")
    return counts


class Mixture:
    """Global sample g -> (source, sample of that source), exact weights in every block of samples."""

    def __init__(self, weights: Sequence[float], start: int = 0, consumed: Sequence[int] | None = None):
        self.counts = block_counts(weights)
        self.block = int(self.counts.sum())
        self.start = start
        self.consumed = np.asarray(consumed if consumed is not None else [0] * len(self.counts), dtype=np.int64)
        source = np.concatenate([np.full(c, s) for s, c in enumerate(self.counts)])
        rank = np.concatenate([np.arange(c) for c in self.counts])
        when = (2 * rank + 1) / (2 * self.counts[source])  # the k-th of c_s sits at (k + 1/2) / c_s of the block
        order = np.lexsort((source, when))
        self.source_of = source[order]  # slot j of a block -> its source
        self.rank_of = rank[order]  # slot j -> which of its source's samples in the block
        onehot = np.zeros((len(self.counts), self.block + 1), dtype=np.int64)
        onehot[self.source_of, np.arange(1, self.block + 1)] = 1
        self.before = np.cumsum(onehot, axis=1)  # [source, j]: that source's slots among the first j

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample within it) of each global sample in g (int64 array, g >= start)."""
        h = np.asarray(g, dtype=np.int64) - self.start
        if (h < 0).any():
            raise ValueError(f"sample {int(np.min(h)) + self.start} is before this mixture's start {self.start}")
        blocks, slot = np.divmod(h, self.block)
        source = self.source_of[slot]
        return source, self.consumed[source] + blocks * self.counts[source] + self.rank_of[slot]

    def consumed_at(self, g: int) -> np.ndarray:
        """Samples each source has served before global sample g."""
        blocks, slot = divmod(g - self.start, self.block)
        return self.consumed + blocks * self.counts + self.before[:, slot]


def mixture_origin(history: list[dict], names: list[str]) -> tuple[int, list[int]]:
    """(start, each named source's samples before it) of the run's current mixture: the last origin a resume
    recorded (elr/train/resume.py's history), or (0, zeros) for the mixture the run began with."""
    for entry in reversed(history):
        if ORIGIN in entry:
            origin = entry[ORIGIN]
            return int(origin["position"]), [int(origin["consumed"].get(name, 0)) for name in names]
    return 0, [0] * len(names)


def continue_mixture(old: list[dict], old_history: list[dict], position: int) -> dict:
    """The origin of a mixture that replaces `old` (its sources as config dicts, started per `old_history`)
    at `position`: each source's count so far, by name, so the new mixture continues every source."""
    names = [s["name"] for s in old]
    start, consumed = mixture_origin(old_history, names)
    counts = Mixture([s["weight"] for s in old], start, consumed).consumed_at(position)
    return {"position": position, "consumed": {name: int(n) for name, n in zip(names, counts)}}


def describe_change(old: list[dict], new: list[dict]) -> str:
    """One phrase for a change of sources: `web 0.6 -> 0.5, math added (0.2), books removed`."""
    before, after = {s["name"]: s for s in old}, {s["name"]: s for s in new}
    parts = []
    for name, s in after.items():
        if name not in before:
            parts.append(f"{name} added ({s['weight']:g})")
            continue
        was = before[name]
        if was["weight"] != s["weight"]:
            parts.append(f"{name} {was['weight']:g} -> {s['weight']:g}")
        for key in ("path", "val_path"):
            if was.get(key) != s.get(key):
                parts.append(f"{name} {key} {was.get(key)!r} -> {s.get(key)!r}")
    parts += [f"{name} removed" for name in before if name not in after]
    return ", ".join(parts) or "reordered"
