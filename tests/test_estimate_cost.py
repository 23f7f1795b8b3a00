"""scripts/estimate_cost.py: the late switch's added compute."""

import subprocess
import sys

import pytest

from trainer_utils import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from estimate_cost import estimate  # noqa: E402


def test_koi_layer_cost_follows_the_formula():
    row = estimate(str(ROOT / "train_configs" / "koi4b.toml"))
    assert row["E[k]"] == pytest.approx(2.35) and row["p1"] == pytest.approx(0.325)
    assert row["run x (layers)"] == pytest.approx(0.5 + 0.5 * (14 + 2.35 * 24 + 14) / 52)


def test_gpt_0p5b_flop_cost_is_close_to_the_paper():
    """The paper reports about 1.16x the baseline's training cost for the GPT-0.5B late switch."""
    row = estimate(str(ROOT / "train_configs" / "gpt_0p5b.toml"))
    assert row["run x (FLOPs)"] == pytest.approx(1.16, abs=0.01)


def test_cli_prints_the_formula():
    out = subprocess.run([sys.executable, "scripts/estimate_cost.py", "train_configs/debug.toml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "cost / baseline = s + (1 - s)" in out.stdout
