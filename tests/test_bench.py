"""scripts/bench.py's multi-rank sampling case runs end to end on gloo (its numbers are for the README, not
asserted: timing belongs in benchmarks, not tests)."""

import os
import subprocess
import sys

import pytest
from trainer_utils import ROOT


@pytest.mark.slow  # spawns gloo ranks and builds a model in each
def test_sampling_bench_times_every_mode_on_two_ranks():
    command = [
        sys.executable,
        "scripts/bench.py",
        "sampling",
        "--ranks",
        "2",
        "--flavor",
        "study_gpt",
        "--seq-len",
        "32",
        "--batch",
        "1",
        "--max-loops",
        "3",
        "--repeats",
        "1",
        "--micro",
        "2",
    ]
    out = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert {"synchronized", "independent", "stratified"} <= rows
    assert "headline: time per unit of work against synchronized" in out.stdout
