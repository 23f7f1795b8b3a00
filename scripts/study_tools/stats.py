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


def seed_range(diffs: dict[int, float]) -> dict | None:
    """Per-seed differences {seed: d} as the switch study reports them: mean, smallest and largest, the count
    of seeds below and above zero; None without a seed."""
    if not diffs:
        return None
    values = [diffs[s] for s in sorted(diffs)]
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "below": sum(v < 0 for v in values),
        "above": sum(v > 0 for v in values),
    }


def fmt_range(r: dict | None) -> str:
    """A relative seed range in percent: `mean (min..max) below/n`, the mean and range over seeds and how
    many seeds lie below zero; one seed prints its value and `1 seed`."""
    if r is None:
        return "–"
    if r["n"] == 1:
        return f"{100 * r['mean']:+.2f}% (1 seed)"
    return f"{100 * r['mean']:+.2f}% ({100 * r['min']:+.2f}..{100 * r['max']:+.2f}) {r['below']}/{r['n']} below"


def sign_word(r: dict | None) -> str:
    """What the signs of a seed range allow one to say, no more: lower or higher on every seed (with at least
    two), split, or one seed."""
    if r is None:
        return "no shared seed"
    if r["n"] == 1:
        return "one seed, no sign verdict"
    if r["below"] == r["n"]:
        return f"lower on {r['n']} of {r['n']} seeds"
    if r["above"] == r["n"]:
        return f"higher on {r['n']} of {r['n']} seeds"
    return f"split ({r['below']} of {r['n']} lower)"
