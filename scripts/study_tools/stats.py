"""Means, spreads and paired differences over seeds.

Variants that share a seed share their initialisation, data order and loop draws, so they are
compared seed by seed: the paired difference removes what the seeds have in common.
"""

from __future__ import annotations

import math
import statistics


def summarise(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired(a: dict[int, float], b: dict[int, float]) -> dict | None:
    """a - b over the seeds both have: mean, sample sd, the count below zero, and t = mean / (sd / sqrt n)
    (inf when every seed agrees exactly); None without a shared seed."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    diffs = [a[s] - b[s] for s in seeds]
    mean, sd = summarise(diffs)
    t = mean / (sd / math.sqrt(len(diffs))) if sd > 0 else (math.copysign(math.inf, mean) if mean else 0.0)
    return {"mean": mean, "sd": sd, "n": len(diffs), "below": sum(d < 0 for d in diffs), "t": t, "diffs": diffs}


def per_seed(entry: dict, k: int) -> dict[int, float]:
    """{seed: validation loss at k} of one variant's report entry (k is 1-based)."""
    return {seed: losses[k - 1] for seed, losses in zip(entry["seeds"], entry["per_seed"])}


def best_k(entry: dict) -> int:
    """The k (2..K) of lowest mean loss in a report entry: the loop count a loop gain is read at."""
    return 2 + min(range(len(entry["loss"]) - 1), key=lambda i: entry["loss"][i + 1])


def fmt_paired(p: dict | None) -> str:
    """A relative paired difference as the reports print it: mean ± sd in percent, seeds below zero."""
    return "–" if p is None else f"{100 * p['mean']:+.2f}% ± {100 * p['sd']:.2f} ({p['below']}/{p['n']} below)"


def relative(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """Per seed, a / b - 1 (a relative paired difference)."""
    return {s: a[s] / b[s] - 1 for s in set(a) & set(b)}


def verdict(diffs: list[float], expected_sign: int) -> str:
    """The word a paired comparison earns against a claimed direction (expected_sign: -1 when the
    claim is "lower", +1 "higher"): "reproduced" when every seed has the claimed sign (with at least
    two seeds), or with more than three seeds when the paired t exceeds 2 in that direction;
    "contradicted" when every seed has the opposite sign; otherwise "inconclusive"."""
    signs = [(d > 0) - (d < 0) for d in diffs]
    if len(diffs) >= 2 and all(s == expected_sign for s in signs):
        return "reproduced"
    if len(diffs) >= 2 and all(s == -expected_sign for s in signs):
        return "contradicted"
    if len(diffs) > 3:
        mean, sd = summarise(diffs)
        if sd > 0 and expected_sign * mean / (sd / math.sqrt(len(diffs))) > 2:
            return "reproduced"
    return "inconclusive"
