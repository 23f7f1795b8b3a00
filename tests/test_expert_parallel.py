"""Expert parallelism: its config checks and rank layout, its pieces on 2 ranks, and whole training
runs under EP, alone and combined with tensor or context parallelism, that equal one process, with
checkpoints moving from EP 2 (and EP 2 x TP 2) to one process.

Slots line up as in tests/test_distributed.py: under EP 2 (one group, 2 microbatches of 2 sequences
per rank) microbatch m of the group holds the samples of the single process's microbatch m (4
sequences), and draws the same k, so every update sees the same tokens at the same depths.
"""

import os
import subprocess
import sys

import pytest
import torch
from trainer_utils import DEBUG_TOML, ROOT, copy_checkpoint, overrides, records, run, run_script

from elr.config import load_config
from elr.errors import ConfigError
from elr.models.from_config import check_model_config
from elr.parallel.parallel_dims import ParallelDims, expert_groups

CKPT = ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0", "--checkpoint.interval", "2"]
FP32 = ["--training.mixed_precision_param", "float32"]
# Independent draws without the override: k differs across microbatches (and across EP groups); the
# route replay, the balance loss and the bias update all run through the expert-parallel path.
MOE = [
    "--elr.one_loop_override",
    "0",
    "--moe.route_replay",
    "true",
    "--moe.aux_loss_coeff",
    "0.01",
    "--moe.bias_update_rate",
    "0.01",
]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["--parallelism.expert_parallel_degree", "0"], "parallelism.expert_parallel_degree"),
        (["--parallelism.expert_parallel_degree", "3"], "parallelism.expert_parallel_degree"),  # 8 experts
        (
            ["--parallelism.expert_parallel_degree", "2", "--model.flavor", "gpt_0p5b"],
            "parallelism.expert_parallel_degree",
        ),
    ],
)
def test_impossible_expert_parallel_degrees_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key) as err:
        check_model_config(load_config(DEBUG_TOML, overrides))
    assert "\n" not in str(err.value)


def test_expert_parallel_degree_must_divide_the_shard_degree():
    with pytest.raises(ConfigError, match="parallelism.expert_parallel_degree"):
        ParallelDims(1, -1, 6, ep=4)
    dims = ParallelDims(2, -1, 8, ep=2)
    assert (dims.dp_shard, dims.ep_groups, dims.loops_shared_by_all) == (4, 4, False)
    assert ParallelDims(1, -1, 8, ep=8).loops_shared_by_all
    assert ParallelDims(1, -1, 4, ep=2, tp=2).loops_shared_by_all  # one group per TP position
    assert ParallelDims(1, -1, 4, ep=2, cp=2).loops_shared_by_all
    assert not ParallelDims(1, -1, 8, ep=2, tp=2).loops_shared_by_all


def test_expert_groups_hold_one_rank_per_shard_position_at_fixed_replicate_cp_and_tp():
    """8 ranks, dp_replicate 1 x dp_shard 4 x tp 2, ep 2: rank = 2 shard + tp. A group pairs shard
    ranks (0, 1) or (2, 3) at one TP position; ep_replicate (a column) holds the same experts."""
    grid = torch.arange(8).view(1, 4, 1, 2)
    assert expert_groups(grid, 2).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    dims = ParallelDims(1, -1, 8, ep=2, tp=2)
    dp_rank = {rank: rank // 2 for rank in range(8)}  # the data-parallel rank of each global rank
    for group in expert_groups(grid, 2).tolist():  # consecutive data-parallel ranks: one loop draw
        assert [dp_rank[r] // dims.ep for r in group] == [dp_rank[group[0]] // dims.ep] * 2
    # cp and replicate: rank = 4 replicate + 2 shard + cp
    grid = torch.arange(8).view(2, 2, 2, 1)
    assert expert_groups(grid, 2).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.slow  # multi-process: the slow tier
def test_dispatch_combine_and_a_unit_called_k_times_on_two_ranks():
    """tests/distributed/expert_parallel_ops.py: all-to-all dispatch/combine vs the one-process grouped
    GEMM (forward and backward), and FSDP2 units called k times per forward vs one process."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "distributed" / "expert_parallel_ops.py"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("==") == 4, result.stdout


@pytest.mark.slow  # ~25 s: one torchrun launch and three in-process runs
def test_ep2_matches_one_process_and_its_checkpoint_loads_in_one_process(tmp_path):
    run(tmp_path / "seed", 4, *CKPT, "--checkpoint.create_seed", "true")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "ep")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "one")
    batch = ["--training.global_batch_size", "8"]
    ep = run_script(
        tmp_path / "ep",
        4,
        *CKPT,
        *FP32,
        *MOE,
        *batch,
        "--training.local_batch_size",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        nproc=2,
    )
    one = run(tmp_path / "one", 4, *CKPT, *MOE, *batch, "--training.local_batch_size", "4")
    ep_loops = [r["loops"] for r in records(tmp_path / "ep")]
    assert all(ks[0] == ks[1] for ks in ep_loops), "both ranks of the expert group run the same k"
    assert any(len(set(ks[0])) > 1 for ks in ep_loops), "microbatches should run different k in some update"
    assert [ks[0] for ks in ep_loops] == [r["loops"][0] for r in records(tmp_path / "one")]
    for step in range(1, 5):
        assert ep[step] == pytest.approx(one[step], rel=1e-5, abs=1e-5), step

    # Expert weights were saved as the full [E, ...] stacks: the one-process run continues from step 2.
    copy_checkpoint(tmp_path / "ep", 2, tmp_path / "ep_to_one")
    ep_to_one = run(tmp_path / "ep_to_one", 4, *CKPT, *MOE, *batch, "--training.local_batch_size", "4")
    for step in (3, 4):
        assert ep_to_one[step] == pytest.approx(ep[step], rel=1e-5, abs=1e-5), step


@pytest.mark.slow  # 4 processes on 2 cores
def test_two_expert_groups_with_different_k_match_one_process(tmp_path):
    """EP 2 x 2 groups (dp_shard 4): the block stays one FSDP unit, the groups draw their own k."""
    run(tmp_path / "seed", 2, *CKPT, "--checkpoint.create_seed", "true")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "ep")
    copy_checkpoint(tmp_path / "seed", 0, tmp_path / "one")
    ep = run_script(
        tmp_path / "ep",
        3,
        *CKPT,
        *FP32,
        *MOE,
        "--training.local_batch_size",
        "1",
        "--parallelism.expert_parallel_degree",
        "2",
        nproc=4,
    )
    one = run(tmp_path / "one", 3, *CKPT, *MOE)  # 2 microbatches of 2 sequences: one per group
    ep_loops = [r["loops"] for r in records(tmp_path / "ep")]
    assert [[[ks[0][0], ks[2][0]]] for ks in ep_loops] == [r["loops"] for r in records(tmp_path / "one")]
    assert all(ks[0] == ks[1] and ks[2] == ks[3] for ks in ep_loops)
    assert any(ks[0] != ks[2] for ks in ep_loops), "the two groups should run different k in some update"
    for step in range(1, 4):
        assert ep[step] == pytest.approx(one[step], rel=1e-5, abs=1e-5), step


EP_TP_CP = str(ROOT / "tests" / "distributed" / "ep_tp_cp.py")


def train_ep_tp_cp(dump, steps: int, *extra: str, nproc: int = 4) -> str:
    """Training through tests/distributed/ep_tp_cp.py (checks each expert group ran one k)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            EP_TP_CP,
            str(DEBUG_TOML),
            *overrides(dump, steps, *extra),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ep_tp_cp: expert groups" in result.stdout, result.stdout
    return result.stdout


def assert_same_run(got: list[dict], want: list[dict], steps) -> None:
    """Losses and loop counts as one process; the clipping norm at 1e-3 (fp32 summation order of the
    head's gradient norm, as in tests/test_tensor_parallel.py)."""
    by_step = {r["step"]: r for r in got if "loss/train" in r}, {r["step"]: r for r in want if "loss/train" in r}
    for step in steps:
        a, b = by_step[0][step], by_step[1][step]
        assert a["loops"][0] == b["loops"][0], step
        assert a["loss/train"] == pytest.approx(b["loss/train"], rel=1e-5, abs=1e-5), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), step


# With 4 ranks, EP 2 x TP 2 (or CP 2) leaves one expert group per TP (CP) position, spanning both
# data-parallel ranks: every rank runs the same k (each recurrent layer is its own FSDP unit). Groups
# that differ in k under EP x TP need 8 ranks: the last test, HSDP 2 x FSDP 2 x TP 2.
BATCH = ["--training.global_batch_size", "8"]


@pytest.mark.slow  # one 4-process run and three in-process runs
@pytest.mark.parametrize("split", ["tensor", "context"])
def test_ep2_x_tp2_or_cp2_matches_one_process_and_its_checkpoint_loads_in_one_process(tmp_path, split):
    """The balance loss on: under CP it is counted over both slices of each sequence."""
    run(tmp_path / "seed", 4, *CKPT, "--checkpoint.create_seed", "true")
    for name in ("ep", "one"):
        copy_checkpoint(tmp_path / "seed", 0, tmp_path / name)
    train_ep_tp_cp(
        tmp_path / "ep",
        4,
        *CKPT,
        *FP32,
        *MOE,
        *BATCH,
        "--training.local_batch_size",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        f"--parallelism.{split}_parallel_degree",
        "2",
    )
    run(tmp_path / "one", 4, *CKPT, *MOE, *BATCH, "--training.local_batch_size", "4")
    got, want = records(tmp_path / "ep"), records(tmp_path / "one")
    assert any(len(set(r["loops"][0])) > 1 for r in got), "microbatches should run different k in some update"
    assert_same_run(got, want, range(1, 5))

    copy_checkpoint(tmp_path / "ep", 2, tmp_path / "ep_to_one")
    run(tmp_path / "ep_to_one", 4, *CKPT, *MOE, *BATCH, "--training.local_batch_size", "4")
    assert_same_run(records(tmp_path / "ep_to_one"), got, (3, 4))


@pytest.mark.slow  # 8 processes on 2 cores (~50 s of the ~75 s)
def test_expert_groups_with_different_k_under_hsdp2_x_ep2_x_tp2_match_one_process(tmp_path):
    """dp_replicate 2 x dp_shard 2 x tp 2, ep 2: two expert groups per TP position, one per replica,
    each drawing its own k (the recurrent block stays one FSDP unit); one sequence per data-parallel
    rank, so group g holds the single process's microbatch g."""
    run(tmp_path / "seed", 3, *CKPT, "--checkpoint.create_seed", "true")
    for name in ("ep_tp", "one"):
        copy_checkpoint(tmp_path / "seed", 0, tmp_path / name)
    train_ep_tp_cp(
        tmp_path / "ep_tp",
        3,
        *CKPT,
        *FP32,
        *MOE,
        "--training.local_batch_size",
        "1",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        nproc=8,
    )
    run(tmp_path / "one", 3, *CKPT, *MOE)  # 2 microbatches of 2 sequences: one per group
    got = records(tmp_path / "ep_tp")
    assert all(ks[0] == ks[1] and ks[2] == ks[3] for ks in (r["loops"] for r in got))
    assert any(ks[0] != ks[2] for ks in (r["loops"] for r in got)), "the groups should run different k in some update"
    for r in got:  # [dp rank][microbatch] -> the single process's [[group 0's k, group 1's k]]
        r["loops"] = [[r["loops"][0][0], r["loops"][2][0]]]
    assert_same_run(got, records(tmp_path / "one"), range(1, 4))
