"""Context parallelism (elr/parallel/context_parallel.py): shards, and 2 gloo ranks against one process."""

import os
import subprocess
import sys

import pytest
import torch

from elr.config import load_config
from elr.models.from_config import model_args_from_config
from elr.parallel.context_parallel import shard_sequence
from elr.parallel.memory_plan import plan_memory
from trainer_utils import DEBUG_TOML, ROOT


def test_shard_sequence_gives_contiguous_slices_and_refuses_uneven_lengths():
    tokens = torch.arange(2 * 12).view(2, 12)
    shards = [shard_sequence(tokens, rank, 3) for rank in range(3)]
    assert [s.shape for s in shards] == [(2, 4)] * 3
    assert torch.equal(torch.cat(shards, dim=1), tokens)
    with pytest.raises(ValueError, match="not divisible"):
        shard_sequence(tokens, 0, 5)


def test_two_cp_ranks_equal_one_process_forward_and_backward():
    """Attention, a GDP layer with convolutions, the GDP op with and without an initial state, and
    the debug model at k = 1 and 3, all to 1e-5 (tests/distributed/cp_layers.py; ~6 s)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests" / "distributed" / "cp_layers.py")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all checks passed" in result.stdout


@pytest.mark.parametrize("ac", ["none", "full"])
def test_memory_plan_traces_one_slice_and_adds_the_gathered_keys_and_values(ac):
    """CP 2 over 64 tokens plans like 32 tokens on 2 FSDP ranks, plus every attention call's other 32
    keys and values: kept for backward without AC, in the recompute working set under full AC."""
    def plan(seq_len, cp):
        cfg = load_config(DEBUG_TOML, ["--training.seq_len", str(seq_len), "--training.local_batch_size", "1",
                                       "--activation_checkpoint.mode", ac,
                                       "--parallelism.context_parallel_degree", str(cp)])
        return plan_memory(cfg, model_args_from_config(cfg, 8192), ngpu=2, gpu_memory_gib=80)

    one_slice, cp = plan(32, 1), plan(64, 2)
    args = model_args_from_config(load_config(DEBUG_TOML), 8192)
    gathered_kv = 2 * 32 * args.n_kv_heads * args.head_dim * 4  # K and V, fp32, 32 more positions
    attention_calls = 2 + (3 - 1) * 1  # debug: two attention layers, one in the loop, run at k = 3
    assert "cp 2" in cp.layout and cp.tokens_per_microbatch == one_slice.tokens_per_microbatch == 32
    assert cp.params == one_slice.params and cp.optimizer == one_slice.optimizer
    if ac == "none":
        assert cp.activations - one_slice.activations == attention_calls * gathered_kv
    else:
        assert cp.activations == one_slice.activations
        assert cp.backward_work - one_slice.backward_work == 2 * gathered_kv
