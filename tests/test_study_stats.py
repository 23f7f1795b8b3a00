"""The study's statistics on fixed numbers: paired differences and the verdict rule."""

import math

import pytest

from elr.tools.study.stats import paired, relative, summarise, verdict


def test_paired_differences_use_shared_seeds_only():
    a, b = {0: 1.0, 1: 2.0, 2: 3.5, 7: 9.0}, {0: 1.5, 1: 2.0, 2: 3.0}
    p = paired(a, b)
    assert p["n"] == 3 and p["diffs"] == [-0.5, 0.0, 0.5] and p["below"] == 1
    assert p["mean"] == pytest.approx(0.0) and p["sd"] == pytest.approx(0.5)
    assert paired({0: 1.0}, {1: 1.0}) is None
    assert relative({0: 1.1, 1: 0.9}, {0: 1.0, 1: 1.0}) == pytest.approx({0: 0.1, 1: -0.1})
    assert summarise([2.0]) == (2.0, 0.0)
    assert math.isinf(paired({0: 2.0, 1: 2.0}, {0: 1.0, 1: 1.0})["t"])


@pytest.mark.parametrize("diffs,sign,word", [
    ([-0.01, -0.02, -0.005], -1, "reproduced"),     # every seed lower, as claimed
    ([0.01, 0.02, 0.005], -1, "contradicted"),      # every seed the other way
    ([-0.01, 0.02, -0.005], -1, "inconclusive"),    # mixed signs, three seeds
    ([0.01, 0.02], 1, "reproduced"),
    ([-0.01], -1, "inconclusive"),                  # one seed earns no verdict
    ([-0.03, -0.02, -0.025, 0.001, -0.02], -1, "reproduced"),  # five seeds, t = -4.4 despite one sign
    ([-0.03, 0.02, -0.025, 0.01, -0.02], -1, "inconclusive"),  # five seeds, t = -1.1
    ([0.0, -0.01, -0.02], -1, "inconclusive"),      # a tie is not the claimed sign
])
def test_verdict_rule(diffs, sign, word):
    assert verdict(diffs, sign) == word
