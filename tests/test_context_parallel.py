"""Context parallelism (elr/parallel/context_parallel.py): shards, and 2 gloo ranks against one process."""

import os
import re
import subprocess
import sys

import pytest
import torch
from trainer_utils import DEBUG_TOML, ROOT, copy_checkpoint, records, run, run_script

from elr.config import load_config
from elr.models.from_config import model_args_from_config
from elr.parallel.context_parallel import lower_right_causal, shard_sequence
from elr.tools.memory_plan import activation_bytes, fake_sequence_meshes, plan_memory


def test_shard_sequence_gives_contiguous_slices_and_refuses_uneven_lengths():
    tokens = torch.arange(2 * 12).view(2, 12)
    shards = [shard_sequence(tokens, rank, 3) for rank in range(3)]
    assert [s.shape for s in shards] == [(2, 4)] * 3
    assert torch.equal(torch.cat(shards, dim=1), tokens)
    with pytest.raises(ValueError, match="not divisible"):
        shard_sequence(tokens, 0, 5)


def test_lower_right_causal_mask_allocates_nothing_of_its_size():
    bias = lower_right_causal(32768, 262144)  # torch's causal_lower_right would allocate 64 GiB here
    assert bias.untyped_storage().nbytes() <= 8
    assert torch.equal(lower_right_causal(2, 4)._materialize(), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool())


@pytest.mark.slow  # multi-process: the slow tier
def test_two_cp_ranks_equal_one_process_and_keep_what_the_memory_plan_traces():
    """Attention, a GDP layer with convolutions, the GDP op with and without an initial state, and
    the debug model at k = 1 and 3, all to 1e-5 (tests/distributed/cp_layers.py; ~10 s). The memory
    plan's count of the last CP rank's activations, traced on the meta device over fake ranks (the
    gathered K/V and GDP's widened values included), is within 5% of what its real forward keeps."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "distributed" / "cp_layers.py"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all checks passed" in result.stdout
    measured = {int(k): int(n) for k, n in re.findall(r"last CP rank at k=(\d): (\d+) bytes", result.stdout)}
    assert measured.keys() == {1, 3}
    args = model_args_from_config(load_config(DEBUG_TOML, ["--training.seq_len", "74"]), 257)
    cfg = load_config(DEBUG_TOML, ["--training.seq_len", "37", "--training.local_batch_size", "2"])  # the slice
    with fake_sequence_meshes(2, 1) as (cp_mesh, _):
        for k, held in measured.items():
            planned = activation_bytes(args, cfg, torch.float32, k, cp_mesh=cp_mesh)
            assert abs(planned - held) <= 0.05 * held, (k, planned, held)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_memory_plan_traces_one_slice_through_the_cp_path(ac):
    """CP 2 over 64 tokens plans a 32-token slice on 2 FSDP ranks, plus at least every attention
    call's other 32 keys and values: kept for backward without AC, in the recompute working set
    (with their gradients) under full AC, where the kept activations are a slice's alone."""

    def plan(seq_len, cp):
        cfg = load_config(
            DEBUG_TOML,
            [
                "--training.seq_len",
                str(seq_len),
                "--training.local_batch_size",
                "1",
                "--activation_checkpoint.mode",
                ac,
                "--parallelism.context_parallel_degree",
                str(cp),
            ],
        )
        return plan_memory(cfg, model_args_from_config(cfg, 8192), ngpu=2, gpu_memory_gib=80)

    one_slice, cp = plan(32, 1), plan(64, 2)
    args = model_args_from_config(load_config(DEBUG_TOML), 8192)
    gathered_kv = 2 * 32 * args.n_kv_heads * args.head_dim * 4  # K and V, fp32, 32 more positions
    attention_calls = 2 + (3 - 1) * 1  # debug: two attention layers, one in the loop, run at k = 3
    assert "cp 2" in cp.layout and cp.tokens_per_microbatch == one_slice.tokens_per_microbatch == 32
    assert cp.params == one_slice.params and cp.optimizer == one_slice.optimizer
    if ac == "none":
        assert cp.activations - one_slice.activations >= attention_calls * gathered_kv
    else:
        assert cp.activations == one_slice.activations
        assert cp.backward_work - one_slice.backward_work >= 2 * gathered_kv


CKPT = ["--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0", "--checkpoint.interval", "2"]
# 74 tokens: slices of 37 at CP 2 and 18.5 -> refused at CP 4; 37 is not a multiple of the GDP chunk
CP_SEQ = ["--training.seq_len", "74", "--validation.freq", "4", "--validation.steps", "2"]


def assert_same_run(got: list[dict], want: list[dict], steps) -> None:
    by_step = {r["step"]: r for r in got if "loss/train" in r}, {r["step"]: r for r in want if "loss/train" in r}
    for step in steps:
        a, b = by_step[0][step], by_step[1][step]
        assert sum(a["loops"], []) == sum(b["loops"], []), step
        assert a["loss/train"] == pytest.approx(b["loss/train"], rel=1e-5), step
        # the fp32 norm of the head's gradient depends on summation order at ~1e-4 (as under TP,
        # tests/test_tensor_parallel.py): the losses, which every gradient feeds, are held to 1e-5
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), step
    val = [[r for r in rs if "val/loss_k1" in r][-1] for rs in (got, want)]
    assert val[0] == pytest.approx(val[1], rel=1e-5)


@pytest.mark.slow  # two 2-process runs and one single-process run
def test_cp2_trains_like_one_process_with_and_without_ac(tmp_path):
    """The trainer under CP 2 (every layer kind, k = 1..3, slices off the GDP chunk) equals one process."""
    run(tmp_path / "seed", 4, *CKPT, *CP_SEQ, "--checkpoint.create_seed", "true")
    for name in ("cp", "cp_ac", "one"):
        copy_checkpoint(tmp_path / "seed", 0, tmp_path / name)
    cp2 = ["--parallelism.context_parallel_degree", "2", *CP_SEQ]
    run_script(tmp_path / "cp", 4, *CKPT, *cp2, nproc=2)
    run_script(tmp_path / "cp_ac", 4, *CKPT, *cp2, "--activation_checkpoint.mode", "full", nproc=2)
    run(tmp_path / "one", 4, *CKPT, *CP_SEQ)
    one = records(tmp_path / "one")
    assert len({tuple(sum(r["loops"], [])) for r in one if "loops" in r}) > 1, "k should change across steps"
    assert_same_run(records(tmp_path / "cp"), one, range(1, 5))
    assert_same_run(records(tmp_path / "cp_ac"), one, range(1, 5))


@pytest.mark.slow  # 4 processes on 2 cores
def test_cp2_x_fsdp2_trains_like_one_process(tmp_path):
    """Two data-parallel ranks (different k) of two CP ranks each; one microbatch per data-parallel rank."""
    per_rank = ["--training.local_batch_size", "1"]
    run(tmp_path / "seed", 2, *CKPT, *CP_SEQ, *per_rank, "--checkpoint.create_seed", "true")
    for name in ("2d", "one"):
        copy_checkpoint(tmp_path / "seed", 0, tmp_path / name)
    run_script(
        tmp_path / "2d",
        2,
        *CKPT,
        *CP_SEQ,
        *per_rank,
        "--parallelism.context_parallel_degree",
        "2",
        "--training.global_batch_size",
        "2",
        nproc=4,
        timeout=400,
    )
    # validation: 2 data-parallel ranks x 2 steps x 1 window = the single process's 4 steps x 1 window
    run(tmp_path / "one", 2, *CKPT, *CP_SEQ, *per_rank, "--training.global_batch_size", "2", "--validation.steps", "4")
    got = records(tmp_path / "2d")
    assert any(len(set(r["loops"][0] + r["loops"][1])) > 1 for r in got if "loops" in r), "replicas should differ in k"
    assert_same_run(got, records(tmp_path / "one"), (1, 2))


@pytest.mark.slow  # 4 processes on 2 cores
def test_cp2_x_tp2_with_balance_loss_trains_like_one_process(tmp_path):
    """Each CP slice of 38 tokens is split again over 2 TP ranks (sequence parallel, 19 each); the MoE
    balance loss (coefficient 0.01) counts routes over all four ranks' pieces of each sequence."""
    seq = [
        "--training.seq_len",
        "76",
        "--validation.freq",
        "3",
        "--validation.steps",
        "2",
        "--moe.aux_loss_coeff",
        "0.01",
    ]
    run(tmp_path / "seed", 3, *CKPT, *seq, "--checkpoint.create_seed", "true")
    for name in ("cp_tp", "one"):
        copy_checkpoint(tmp_path / "seed", 0, tmp_path / name)
    run_script(
        tmp_path / "cp_tp",
        3,
        *CKPT,
        *seq,
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--activation_checkpoint.mode",
        "full",
        nproc=4,
        timeout=400,
    )
    run(tmp_path / "one", 3, *CKPT, *seq)
    got, one = records(tmp_path / "cp_tp"), records(tmp_path / "one")
    assert_same_run(got, one, range(1, 4))
    moe = [[r["moe/aux_loss"] for r in rs if "moe/aux_loss" in r] for rs in (got, one)]
    assert moe[0] and moe[0] == pytest.approx(moe[1], rel=1e-5)
    # per-loop statistics (update norm, step size, FiLM gate) describe whole sequences, as in one process
    for a, b in zip((r for r in got if "loss/train" in r), (r for r in one if "loss/train" in r)):
        loop_keys = [key for key in b if key.startswith("loop") and "/" in key]
        assert loop_keys and {key: a[key] for key in loop_keys} == pytest.approx(
            {key: b[key] for key in loop_keys}, rel=1e-4
        )


@pytest.mark.slow  # inductor compiles the GDP and attention layers: ~7 min cold on 2 cores, ~100 s warm
def test_cp2_with_inductor_compiled_layers_equals_one_eager_process():
    """tests/distributed/cp_compile.py: the debug model at k = 3, its GDP and attention layers compiled,
    logits and gradients (summed over the CP ranks) within 1e-5 of the uncompiled model on the whole
    sequence. (aot_eager cannot be used: it fails on the GDP layer's backward with or without CP.)"""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "distributed" / "cp_compile.py"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("inductor: logits") == 2
