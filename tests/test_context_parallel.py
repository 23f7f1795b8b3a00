"""Context parallelism (elr/parallel/context_parallel.py): shards, and 2 gloo ranks against one process."""

import os
import subprocess
import sys

import pytest
import torch

from elr.parallel.context_parallel import shard_sequence
from trainer_utils import ROOT


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
