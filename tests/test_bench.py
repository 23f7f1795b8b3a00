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


@pytest.mark.slow  # inductor compiles the decode step (minutes on a cold cache)
def test_decode_bench_compares_eager_compiled_and_transformers_on_the_same_tokens(tmp_path):
    pytest.importorskip("transformers")
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "decode", "--flavor", "debug", "--max-loops", "2"]
    command += ["--batches", "2", "--decode-loops", "2", "--seq-len", "6", "--new-tokens", "3", "--repeats", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:2] == ["2", "2"])
    assert row[-1] == "2/2"  # eager, compiled and transformers' generate decoded the same tokens
    assert "k = 1 decode steps, ELR against the non-recurrent model" in out.stdout


@pytest.mark.slow  # inductor compiles both models' decode steps
def test_one_loop_bench_times_both_models_and_counts_the_learned_step(tmp_path):
    import dataclasses

    import torch

    from elr.config.recurrence import RecurrenceOptions
    from elr.models import build_model, flavors

    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "one_loop", "--flavor", "debug", "--max-loops", "2"]
    command += ["--batches", "1", "2", "--new-tokens", "3", "--repeats", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])] == ["1", "2"]
    with torch.device("meta"):
        base = build_model(dataclasses.replace(flavors["debug"], recurrence=RecurrenceOptions.baseline()))
    dim = flavors["debug"].dim
    expected = 1 + 6 * dim * dim / base.num_flops_per_token(3, 1)  # the learned step's projection, per token
    assert f"FLOPs per token ELR / baseline at k = 1: {expected:.4f}" in out.stdout
