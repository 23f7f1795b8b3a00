"""FSDP2 on 2 gloo ranks with different loop counts per rank equals one process, and checkpoints
move between world sizes (2 -> 1, 1 -> 2) with the data position carried over.

The slots line up: rank r's microbatch holds the same samples, and draws the same k, as the single
process's microbatch r (same global batch), so every update sees the same tokens at the same depths.
"""

import os
import subprocess
import sys

import pytest
from trainer_utils import ROOT, copy_checkpoint, records, run, run_script

CKPT = ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0", "--checkpoint.interval", "2"]
FP32 = ["--training.mixed_precision_param", "float32"]
# FiLM on the output block beside the loops' (debug.toml has the loops'): every conditioning head is
# sharded, and the output block's FiLM is computed while FSDP holds the recurrent block unsharded.
EXIT = ["--elr.conditioning_exit", "true"]


@pytest.mark.slow
def test_two_ranks_match_one_process_and_reshard_both_ways(tmp_path):
    # Sharded initialisation draws other numbers than one process does: start both from one seed.
    run(tmp_path / "seed", 4, *CKPT, *EXIT, "--checkpoint.create_seed", "true")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "two")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "one")
    two = run_script(tmp_path / "two", 4, *CKPT, *EXIT, *FP32, "--training.local_batch_size", "2", nproc=2)
    one = run(tmp_path / "one", 4, *CKPT, *EXIT)
    loops = [r["loops"] for r in records(tmp_path / "two")]
    assert any(len(set(sum(ks, []))) > 1 for ks in loops), "ranks should run different k in some update"
    assert [sum(ks, []) for ks in loops] == [sum(r["loops"], []) for r in records(tmp_path / "one")]
    for step in range(1, 5):
        assert two[step] == pytest.approx(one[step], rel=2e-5, abs=2e-5), step
    # Who waits for whom: the draws' wait factor every step (above 1 exactly when the ranks' k differ on
    # some microbatch), the ranks' measured loop times gathered at each console line.
    for r in records(tmp_path / "two"):
        differ = any(len(set(column)) > 1 for column in zip(*r["loops"]))
        assert (r["loops/wait_expected"] > 1.0) == differ, r
        if "loops/wait_measured" in r:
            assert r["loops/wait_measured"] >= 1.0 and r["loops/idle_ms_max"] >= r["loops/idle_ms_mean"] >= 0.0
    assert any("loops/wait_measured" in r for r in records(tmp_path / "two"))

    copy_checkpoint(tmp_path / "two", 2, tmp_path / "two_to_one")
    two_to_one = run(tmp_path / "two_to_one", 4, *CKPT, *EXIT)
    copy_checkpoint(tmp_path / "one", 2, tmp_path / "one_to_two")
    one_to_two = run_script(tmp_path / "one_to_two", 4, *CKPT, *EXIT, *FP32, nproc=2)
    for step in (3, 4):
        assert two_to_one[step] == pytest.approx(two[step], rel=2e-5, abs=2e-5), step
        assert one_to_two[step] == pytest.approx(one[step], rel=2e-5, abs=2e-5), step


@pytest.mark.slow  # multi-process: the slow tier
def test_hsdp_two_replicas_of_two_shards_match_one_process(tmp_path):
    run(tmp_path / "seed", 2, *CKPT, "--checkpoint.create_seed", "true")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "hsdp")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "one")
    per_rank = ["--training.local_batch_size", "1"]
    hsdp = run_script(
        tmp_path / "hsdp", 2, *CKPT, *FP32, *per_rank, "--parallelism.data_parallel_replicate_degree", "2", nproc=4
    )
    one = run(tmp_path / "one", 2, *CKPT, *per_rank)
    for step in (1, 2):
        assert hsdp[step] == pytest.approx(one[step], rel=2e-5, abs=2e-5), step


@pytest.mark.slow  # multi-process: the slow tier
def test_muon_under_fsdp_on_two_ranks_equals_one_process():
    """A row-split matrix is gathered for Newton-Schulz, an expert-split stack is not
    (tests/distributed/muon_fsdp.py)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "distributed" / "muon_fsdp.py"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
